"""Decode attention over a bf16 or int8 KV cache at memory bandwidth: a small C++ op built at first use.

The decode step's attention is cache-bound at many rows: each row reads all its keys and values once.
Torch's bf16 SDPA reads a bf16 cache far below the bandwidth its bytes allow (on a Zen 4 box a step's
attention takes 2-3x as long as on an fp32 cache of twice the bytes: ``bench attention``), so
``decode_attention.cpp`` reads the engine's slot layout ``[slots, kv_heads, positions, head_dim]``
directly: every row's keys and values of its own slot once, bf16 converted to fp32 in registers, dots,
softmax and weighted sum in fp32, split into fixed chunks of positions across threads
(flash-decoding). A row's result depends only on its own query and keys (batch-invariant), and it is
deterministic: chunks are combined in order whatever the thread count.

An int8 cache (``--kv-cache-dtype int8``, ``kernels.kv_int8``: int8 vectors with one fp32 scale each) has
its own op over the same loop, in integers: the query rounded once to int16 (15 bits over its largest
value), each dot an exact int32 sum of int16 x int8 products, each block's softmax weights (times the
values' scales) rounded to int16 and multiplying pairs of positions' values the same way; each key's
scale folded into its dot and each value's into its weight. It reads 68 bytes a vector where bf16 reads
128 (at head_dim 64) and dequantizes nothing into memory; the two int16 roundings add ~1/65534 of a
query's and a block's largest weight, 1/258 of the int8 numbers' own step (widening int8 to fp32 instead
cost two conversions a 16 numbers before each FMA: on a Zen 4 most of a 32-row step's attention). Where
the op cannot run, ``Attention._attend_rows`` dequantizes each row's keys to fp32 in torch (fp32 math,
slower: the op's result up to those two roundings).

Where it runs: a CPU with AVX-512 (torch's own probe, ``torch.backends.cpu.get_cpu_capability``), a
bf16 or int8 cache, and a C++ compiler and ninja to build it (the first build takes ~30-60 s and is cached
per user, ``TORCH_EXTENSIONS_DIR``). Elsewhere, or when the build fails (a slim container without a
compiler), decode attention stays on torch's SDPA with one warning. An fp32 cache never uses it (the
fp32 mode stays bit-exact with its own attention). ``CHATTTS_DECODE_ATTENTION=torch`` turns it off.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .. import cpu
from . import cpp_build

MODE_ENV = "CHATTTS_DECODE_ATTENTION"
""""auto" (default): the C++ kernel where it applies; "torch": always torch's SDPA."""
_SOURCE = Path(__file__).with_name("decode_attention.cpp")
# The kernel is written with AVX-512 F/BW/VL/DQ intrinsics (no BF16 instructions): any AVX-512 CPU runs it.
# The int8 cache's integer dots take VNNI's vpdpwssd where the CPU has it (else vpmaddwd + vpaddd: the
# same integers); the flag is chosen per machine, as the build is (cached per user).
_CFLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-fopenmp"]


def cpu_supported() -> bool:
    """Whether this CPU runs the kernel: AVX-512 (as torch's dispatch sees it, so ATEN_CPU_CAPABILITY
    lowered to avx2 turns it off too)."""
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def _flags() -> list[str]:
    """This CPU's build: VNNI where it has it; on a Zen 4 the int8 cache's prefetch distance that measured
    best there (decode_attention.cpp's kAhead)."""
    flags = _CFLAGS + (["-mavx512vnni"] if torch.cpu._is_vnni_supported() else [])
    if cpu.probe().core == "zen4":
        flags.append("-DCHATTTS_INT8_AHEAD=16")
    return flags


_library = cpp_build.Library(
    "chattts_decode_attention", _SOURCE, _flags, "decode attention over the bf16/int8 KV cache runs on torch (slower)"
)


def applies(k_cache: torch.Tensor) -> bool:
    """Whether ``attend`` runs for this layer cache ``[slots, kv_heads, positions, head_dim]``: bf16 or int8
    on the CPU, head_dim a multiple of 16 up to 128, an AVX-512 CPU, not turned off, and the op built.
    Cheap after the first call (the build is attempted once)."""
    if k_cache.dtype not in (torch.bfloat16, torch.int8) or k_cache.device.type != "cpu":
        return False
    d = k_cache.shape[-1]
    if d % 16 or d > 128 or os.environ.get(MODE_ENV, "auto") == "torch" or not cpu_supported():
        return False
    return _library.loaded()


def prepare(k_cache: torch.Tensor) -> bool:
    """Build the op now if it will be used for this cache (start-up, not the first request's step)."""
    return applies(k_cache)


def attend(
    q: torch.Tensor,  # [rows, heads, head_dim], any float dtype
    k_cache: torch.Tensor,  # [slots, kv_heads, positions, head_dim] bf16 or int8
    v_cache: torch.Tensor,
    slots: torch.Tensor,  # [rows] int64: each row's cache slot
    last: torch.Tensor,  # [rows] int64: each row's last position; it attends to 0..last
    scale: float,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # int8: key and value scales [slots, kv_heads, positions]
) -> torch.Tensor:
    """softmax(q k^T * scale) v over each row's positions 0..last[row] of its slot, fp32 ``[rows, heads,
    head_dim]``; query heads share kv heads in groups (GQA) when heads > kv_heads. An int8 cache's keys
    and values are ``k_cache * scales[0][..., None]`` and ``v_cache * scales[1][..., None]``. Call only where
    ``applies(k_cache)``."""
    if q.dim() != 3 or q.shape[0] != slots.numel() or q.shape[0] != last.numel():
        raise ValueError(f"q must be [rows, heads, head_dim], one slot and one last position per row; got {q.shape}")
    if (k_cache.dtype == torch.int8) != (scales is not None):
        raise ValueError("an int8 cache needs its scales, and only an int8 cache takes them")
    if scales is not None:
        ks, vs = scales
        return torch.ops.chattts_decode_attention.int8(q.float(), k_cache, v_cache, ks, vs, slots, last, float(scale))
    return torch.ops.chattts_decode_attention.bf16(q.float(), k_cache, v_cache, slots, last, float(scale))


def reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    last: torch.Tensor,
    scale: float,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``attend`` in plain torch, row by row in float64 (the tests' oracle; slow); an int8 cache dequantized
    in float64, its query rounded to int16 as the op rounds it (``int16_query``). What is left against the op
    is fp32 rounding and, for int8, the rounding of each block's weights to int16."""
    rep = q.shape[1] // k_cache.shape[1]
    if scales is not None:
        q, scale = int16_query(q, scale), 1.0
    outs = []
    for row, (slot, end) in enumerate(zip(slots.tolist(), last.tolist(), strict=True)):
        keys = k_cache[slot, :, : end + 1].double()
        values = v_cache[slot, :, : end + 1].double()
        if scales is not None:
            keys = keys * scales[0][slot, :, : end + 1, None].double()
            values = values * scales[1][slot, :, : end + 1, None].double()
        keys, values = keys.repeat_interleave(rep, dim=0), values.repeat_interleave(rep, dim=0)
        weights = torch.softmax((q[row].double()[:, None] @ keys.transpose(-1, -2)) * scale, dim=-1)
        outs.append((weights @ values)[:, 0])
    return torch.stack(outs).float()


def int16_query(q: torch.Tensor, scale: float) -> torch.Tensor:
    """``q * scale`` as the int8 op reads it, in float64: each head's fp32 ``q * scale`` rounded to int16 codes
    over its largest |value| (``code = round(x * (32767 / amax))``, half to even, in fp32) times ``amax /
    32767``."""
    x = q.float() * torch.tensor(scale, dtype=torch.float32)
    amax = x.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(32767.0) / amax, torch.zeros(()))
    codes = torch.round(x * inv)
    return codes.double() * (amax / 32767.0).double()
