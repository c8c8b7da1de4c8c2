"""Decode attention that reads each row's own length, not the whole context bucket: FlexAttention with a
block mask built from the rows' positions, for the static (graph-captured) decode step on CUDA.

The static step attends row b (= slot b) over the first ``ctx`` cache positions, ``ctx`` a bucket, and
hides the keys past the row's own with a boolean mask: SDPA still reads every key of the bucket, so at
256 rows a step reads the whole bucket's cache (4-8 GB) whatever the rows' lengths. FlexAttention
(``torch.nn.attention.flex_attention``, in torch since 2.5; every call here exists in torch 2.11) skips
whole key blocks a ``BlockMask`` leaves out: the mask here is built on the device from the positions
(``BlockMask.from_kv_blocks``: row b reads blocks ``0 .. positions[b] // BLOCK``, the last one masked
per key), so there is no host value and the step stays graph-capturable, and a row reads about its own
length rounded up to a block. On CUDA the call is ``torch.compile``d (FlexAttention's Triton
kernels; short queries take its decoding kernel), compiled at the step graphs' warm-up, never inside a
capture. Elsewhere it runs FlexAttention's eager reference (slow; the tests check the choice on the CPU
against the float64 reference of ``kernels.decode_attention``).

``CHATTTS_CUDA_ATTENTION``: "auto" (default: flex on CUDA when a probe of it runs, else SDPA with one
warning), "flex" or "sdpa".
"""

from __future__ import annotations

import functools
import logging
import os
import warnings

import torch

log = logging.getLogger(__name__)

MODE_ENV = "CHATTTS_CUDA_ATTENTION"
BLOCK = 128
"""Keys per block of the mask (FlexAttention's default block size): a row reads its length rounded up."""


def length_block_mask(positions: torch.Tensor, ctx: int):
    """The ``BlockMask`` of rows that attend to keys ``0 .. positions[b]`` of ``ctx`` (one query each).
    Built from device tensors only (no host read): capturable in a CUDA graph."""
    from torch.nn.attention.flex_attention import BlockMask

    rows = positions.shape[0]
    blocks = -(-ctx // BLOCK)
    kv_num = (positions.clamp(max=ctx - 1) // BLOCK + 1).to(torch.int32).view(rows, 1, 1)
    kv_idx = torch.arange(blocks, dtype=torch.int32, device=positions.device).view(1, 1, 1, blocks)
    kv_idx = kv_idx.expand(rows, 1, 1, blocks).contiguous()

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx <= positions[b]

    return BlockMask.from_kv_blocks(kv_num, kv_idx, BLOCK_SIZE=BLOCK, mask_mod=mask_mod, seq_lengths=(1, ctx))


@functools.cache
def _compiled():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True)


def attend(
    q: torch.Tensor,  # [rows, heads, 1, head_dim]
    keys: torch.Tensor,  # [rows, kv_heads, ctx, head_dim]: row b's slot, the bucket's positions
    values: torch.Tensor,
    positions: torch.Tensor,  # [rows] int64: row b attends to keys 0..positions[b]
    scale: float,
    compiled: bool | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale) v over each row's own keys, ``[rows, heads, 1, head_dim]`` (GQA when heads
    > kv_heads). ``compiled``: FlexAttention's compiled kernels (default: on CUDA)."""
    from torch.nn.attention.flex_attention import flex_attention

    if compiled is None:
        compiled = q.is_cuda
    fn = _compiled() if compiled else flex_attention
    mask = length_block_mask(positions, keys.shape[2])
    gqa = q.shape[1] != keys.shape[1]
    with warnings.catch_warnings():  # the eager reference warns that it is not the compiled kernel
        warnings.simplefilter("ignore", UserWarning)
        return fn(q, keys, values, block_mask=mask, scale=scale, enable_gqa=gqa)


def _probe(device: torch.device, dtype: torch.dtype) -> None:
    """One small call as the step makes it (compiled on CUDA), checked against SDPA; raises if it fails."""
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(2, 2, n, 64, generator=g).to(device, dtype) for n in (1, 256, 256))
    pos = torch.tensor([3, 200], device=device)
    got = attend(q, k, v, pos, 0.125)
    mask = (torch.arange(256, device=device)[None] <= pos[:, None])[:, None, None]
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125)
    if not torch.allclose(got.float(), want.float(), atol=2e-2 if dtype != torch.float32 else 1e-4):
        raise RuntimeError("flex attention disagrees with SDPA on the probe")


@functools.cache
def choose(device_type: str, dtype: torch.dtype, device_index: int | None = None) -> str:
    """The static step's attention: "flex" (each row's own length) or "sdpa" (the bucket, masked). "auto"
    picks flex on CUDA when its probe runs; off CUDA SDPA (FlexAttention's CPU kernels need a compile
    per shape, and the CPU decodes in the rows mode anyway). Read once, by ``engine.plan.resolve_plan``
    (``ExecutionPlan.attention``)."""
    mode = os.environ.get(MODE_ENV, "auto")
    if mode not in ("auto", "flex", "sdpa"):
        raise ValueError(f"{MODE_ENV} must be auto, flex or sdpa; got {mode!r}")
    if mode == "sdpa" or (mode == "auto" and device_type != "cuda"):
        return "sdpa"
    if mode == "flex" and device_type != "cuda":
        return "flex"
    try:
        _probe(torch.device(device_type, device_index), dtype)
    except Exception as exc:  # no Triton, an old torch, a compile failure: the masked SDPA still works
        if mode == "flex":
            raise
        log.warning("flex attention is not available here (%s); the decode step reads whole context buckets", exc)
        return "sdpa"
    return "flex"
