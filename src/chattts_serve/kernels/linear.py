"""Linear layers with weights pre-packed for oneDNN (CPU, fp32/bf16): a module swap chosen by the engine.

Why: on our CPUs, MKL's fp32 GEMM re-packs the weight on every call, so a decode step with 4-32 rows
costs 5-7x a 1-row GEMV; oneDNN with a weight packed once runs 4 rows at GEMV cost and 32 rows at a
fraction of it. It is also batch-invariant: a row's result is bit-identical whatever the number of
rows (checked for 1..64 rows, 1 and 2 threads), which the engine's determinism contract needs. It is
not bit-identical to MKL's GEMV, so the engine keeps plain ``F.linear`` in its reference-exact mode.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """fp32 on any x86 CPU with oneDNN; bf16 only where the CPU has the instructions oneDNN's packed
    bf16 path needs (AVX-512 BW/VL/DQ or AVX-NE-CONVERT); it refuses to pack otherwise."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        try:
            pack_weight(torch.zeros(16, 16, dtype=torch.bfloat16))
        except RuntimeError:
            return False
        return True
    return False


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


def on_rows(
    x: torch.Tensor, matmul: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Apply a kernel that takes contiguous 2-D input of ``dtype`` to x [..., in]. A decode step's input
    already is one and goes straight in (each extra call costs there); anything else is reshaped."""
    dtype = dtype or x.dtype
    if x.dim() == 2 and x.dtype == dtype and x.is_contiguous():
        return matmul(x)
    y = matmul(x.reshape(-1, x.shape[-1]).to(dtype).contiguous())
    return y.reshape(*x.shape[:-1], y.shape[-1])


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return on_rows(x, lambda rows: torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], ""))


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed", pack_weight(linear.weight), persistent=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed, self.bias)


def swap_linears_(module: nn.Module, make: Callable[[str, nn.Linear], nn.Module], prefix: str = "") -> int:
    """Replace every ``nn.Linear`` under ``module`` by ``make(qualified_name, linear)``; returns the count."""
    count = 0
    for name, child in list(module.named_children()):
        qual = f"{prefix}{name}"
        if isinstance(child, nn.Linear):
            setattr(module, name, make(qual, child))
            count += 1
        else:
            count += swap_linears_(child, make, qual + ".")
    return count


def pack_linears_(module: nn.Module) -> int:
    """Replace every ``nn.Linear`` inside ``module`` by a ``PackedLinear`` (in place); returns how many."""
    return swap_linears_(module, lambda _name, lin: PackedLinear(lin))


def linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None) -> torch.Tensor:
    return packed_linear(x, packed) if packed is not None else F.linear(x, weight)
