"""The int8 KV cache's number format (``--kv-cache-dtype int8``): one symmetric absmax scale per vector.

Each key and each value vector (one position of one kv head: ``head_dim`` numbers) is stored as int8
``round(x / s)`` with ``s = max|x| / 127``, and ``s`` beside it in fp32. Per vector, not per block of
positions: a vector's bytes depend only on its own values, so what a row writes is the same whatever else
runs in the step (batch invariance) and whether its prompt was prefilled in one call or in chunks.

Why fp32 scales and not bf16: a bf16 scale rounds by up to 2^-9 of itself, an error as large as int8's own
step (1/254 of max|x|) and the same sign on every number of the vector; and it would save 2 of 66 bytes a
vector at head_dim 64 (3 %). fp32 scales make the cache 68 bytes a vector, 0.53 of bf16's 128.
"""

from __future__ import annotations

import torch

SCALE_DTYPE = torch.float32
"""The dtype of the per-vector scales (see the module docstring)."""

QMAX = 127
"""Symmetric: -127..127 (int8's -128 is never written, so negation is exact)."""


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] (any float dtype) -> int8 [..., head_dim] and fp32 scales [...]; x ~ q * scale."""
    x = x.float()
    scale = x.abs().amax(dim=-1) / QMAX
    # An all-zero vector: scale 0, and x / tiny is 0 (no 0/0).
    q = torch.round(x / scale.clamp_min(torch.finfo(SCALE_DTYPE).tiny)[..., None]).clamp_(-QMAX, QMAX)
    return q.to(torch.int8), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """int8 [..., head_dim] and scales [...] -> ``dtype`` [..., head_dim], computed in fp32 (the kernel's math)."""
    out = q.float() * scale.float()[..., None]
    return out if dtype == torch.float32 else out.to(dtype)
