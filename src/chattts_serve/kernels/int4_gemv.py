"""A 4-bit weight GEMV for decode steps of 1-8 rows at the memory's rate: a small C++ op built at first use.

At one row a decode step's matmuls read every weight once and do two operations per byte: their time
is the weights' bytes over the read bandwidth, if the kernel keeps up. The libraries' 4-bit kernels
do not on Zen 4/5 (ONNX Runtime's ``MatMulNBits`` at 0.5-0.6 of that floor, torch's int4 and OpenVINO's
at a third: ``bench kernels``), so ``int4_gemv.cpp`` streams a layout packed for its own inner loop:
tiles of 32 output channels, each one contiguous run of cache lines (codes, then the block's scales),
nibbles unpacked with a mask and multiplied with VNNI ``vpdpbusd`` (u8 weight codes x s8 activations,
as MLAS's accuracy level 4). The weights are symmetric int4 in blocks of 32, 64 or 128 inputs with an
fp32 or bf16 scale per block and channel; the activations are quantised to int8 per row and block
(``quantize_rows``), so a row's result does not depend on the other rows (batch-invariant), and it
does not depend on the thread count either (threads split whole tiles).

Where it runs: a CPU with AVX-512 VNNI, a C++ compiler and ninja (the first build takes ~30-60 s and is
cached per user, ``TORCH_EXTENSIONS_DIR``). Elsewhere, or when the build fails, ``pack`` keeps the
dequantised weight in fp32 and ``linear`` multiplies it with torch (same weights, fp32 activations:
slower, not the same rounding), after one warning.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import malloc
from . import cpp_build
from .linear import on_rows

BLOCKS = (32, 64, 128)
TILE = 32
"""Output channels per tile of the packed layout (the kernel's two vectors of 16 lanes)."""
PREFETCH_ENV = "CHATTTS_INT4_GEMV_PREFETCH"
"""Bytes ahead of the stream the kernel prefetches (0: the hardware prefetcher alone)."""
DEFAULT_PREFETCH = 8192
"""On Zen 5, one thread, one row: the hardware prefetcher alone reads at 0.55 of the floor, 2 KB ahead
0.66, 4-8 KB ahead 0.74 (the large ops 0.79-0.81), 16 KB 0.72. With the step's weights on huge pages
(``one_stream``) 8 KB beats 4 KB: the one-row step 3.52 -> 3.34 ms at 1 thread (8 interleaved rounds, each
lower), 3.41 -> 3.22 at 2; 32 rows and the prompts' prefill unchanged."""
_SOURCE = Path(__file__).with_name("int4_gemv.cpp")
# -ffp-contract=off: int4_decode's elementwise loops round as torch's separate ops do (no fused multiply-add).
_CFLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mfma", "-fopenmp"]
_CFLAGS += ["-ffp-contract=off"]


def cpu_supported() -> bool:
    """AVX-512 as torch's dispatch sees it (ATEN_CPU_CAPABILITY lowered to avx2 turns it off) and VNNI."""
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512") and torch.cpu._is_vnni_supported()


_library = cpp_build.Library(
    "chattts_int4_gemv",
    _SOURCE,
    lambda: _CFLAGS,
    "the int4 GEMV runs as a dequantised fp32 matmul (slower)",
    lambda: None if cpu_supported() else "this CPU has no AVX-512 VNNI",
)


def available() -> bool:
    """Whether the C++ op runs here (built on the first call)."""
    return _library.loaded()


@dataclass(frozen=True, slots=True)
class Int4GemvWeight:
    blob: torch.Tensor
    """uint8, the kernel's stream: per tile of 32 channels, per block, codes then scales (empty when
    ``dense`` is used instead)."""
    in_features: int
    out_features: int
    block: int
    bf16_scales: bool
    dense: torch.Tensor | None = None
    """The dequantised fp32 weight, where the kernel does not run."""

    @property
    def nbytes(self) -> int:
        t = self.dense if self.dense is not None else self.blob
        return t.numel() * t.element_size()


def one_stream(weights: Sequence[Int4GemvWeight]) -> list[Int4GemvWeight]:
    """The same weights, their packed streams copied in this order into one buffer on huge pages
    (``malloc.huge_pages``): the decode step reads them front to back every step. The copies replace the
    originals (keep only what this returns), so nothing is held twice."""
    if any(w.dense is not None for w in weights):
        return list(weights)
    buffer = malloc.huge_pages(sum(w.blob.numel() for w in weights))
    out, at = [], 0
    for w in weights:
        n = w.blob.numel()
        out.append(replace(w, blob=buffer[at : at + n].copy_(w.blob)))
        at += n
    return out


def quantize(
    w: torch.Tensor, block: int, scale_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int4 per block of ``block`` inputs: (codes [out, in] int8 in [-8, 7], scales [out, in /
    block] fp32, already rounded to ``scale_dtype``) with ``w ~= codes * scale``.

    As MLAS does: the block's value of largest magnitude maps to -8 (the scale is its value / -8, of
    either sign), so all 16 codes are used; steps an eighth finer than absmax / 7 (the step's relative
    error 0.15 -> 0.13 on random weights, ORT's MatMulNBits figure). A value of the other sign and the
    same magnitude clamps to 7 (one step off)."""
    out, inp = w.shape
    if block not in BLOCKS:
        raise ValueError(f"block must be one of {BLOCKS}, got {block}")
    if inp % block:
        raise ValueError(f"input features {inp} are not a multiple of the block size {block}")
    if scale_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"scales are fp32 or bf16, not {scale_dtype}")
    wb = w.detach().float().reshape(out, inp // block, block)
    peak = wb.gather(-1, wb.abs().argmax(-1, keepdim=True))[..., 0]
    scale = (peak / -8.0).to(scale_dtype).float()
    safe = torch.where(scale != 0, scale, torch.ones_like(scale))
    q = torch.round(wb / safe[..., None]).clamp_(-8, 7).to(torch.int8)
    return q.reshape(out, inp), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float64 weight ``codes * scale`` the kernel multiplies by."""
    out, inp = q.shape
    blocks = scale.shape[1]
    return (q.double().reshape(out, blocks, inp // blocks) * scale.double()[..., None]).reshape(out, inp)


def pack_codes(q: torch.Tensor, scale: torch.Tensor, block: int, bf16_scales: bool) -> torch.Tensor:
    """Codes and scales in the kernel's stream (see int4_gemv.cpp): uint8 [tiles * tile bytes]."""
    out, inp = q.shape
    blocks, steps = inp // block, block // 8
    pad = -out % TILE
    u = (q.to(torch.int16) + 8).to(torch.uint8)  # unsigned codes 0..15; padding channels: 8, i.e. 0
    s = scale.float()
    if pad:
        u = torch.cat([u, torch.full((pad, inp), 8, dtype=torch.uint8)])
        s = torch.cat([s, s.new_zeros(pad, blocks)])
    tiles = (out + pad) // TILE
    # [tile, half, lane, block, step, nibble, j] -> [tile, block, step, half, lane, j, nibble]:
    # input block * B + step * 8 + nibble * 4 + j of channel tile * 32 + half * 16 + lane.
    u = u.reshape(tiles, 2, 16, blocks, steps, 2, 4).permute(0, 3, 4, 1, 2, 6, 5)
    codes = (u[..., 0] | (u[..., 1] << 4)).reshape(tiles, blocks, steps * 128)
    s = s.reshape(tiles, TILE, blocks).transpose(1, 2).contiguous()
    s = (s.bfloat16() if bf16_scales else s).view(torch.uint8).reshape(tiles, blocks, -1)
    return torch.cat([codes, s], dim=-1).reshape(-1).contiguous()


def pack(w: torch.Tensor, block: int = 128, scale_dtype: torch.dtype = torch.float32) -> Int4GemvWeight:
    """Quantise an fp32 [out, in] weight and pack it, once, for ``linear``."""
    q, scale = quantize(w, block, scale_dtype)
    out, inp = w.shape
    bf16 = scale_dtype == torch.bfloat16
    if available():
        return Int4GemvWeight(pack_codes(q, scale, block, bf16), inp, out, block, bf16)
    return Int4GemvWeight(torch.empty(0, dtype=torch.uint8), inp, out, block, bf16, dequantize(q, scale).float())


def linear(x: torch.Tensor, w: Int4GemvWeight) -> torch.Tensor:
    """x [..., in] (any float dtype) @ the weight -> fp32 [..., out]."""
    if w.dense is not None:
        return on_rows(x, lambda rows: F.linear(rows, w.dense), torch.float32)
    # A decode step makes ~80 of these calls of 40-150 us each: the overload is resolved once (the
    # packet's lookup costs ~1 us a call).
    op = _gemv()
    prefetch = prefetch_distance()
    return on_rows(x, lambda rows: op(rows, w.blob, w.out_features, w.block, w.bf16_scales, prefetch), torch.float32)


def prefetch_distance() -> int:
    """``CHATTTS_INT4_GEMV_PREFETCH``, else ``DEFAULT_PREFETCH``."""
    return int(os.environ.get(PREFETCH_ENV, DEFAULT_PREFETCH))


@functools.cache
def _gemv():
    return torch.ops.chattts_int4_gemv.gemv.default


def quantize_rows(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's int8 activations: (codes [rows, in] as float, scales [rows, in / block]), each
    code round-half-even(x * (127 / absmax)) in fp32 and scale absmax / 127, per row and block."""
    rows, inp = x.shape
    xb = x.float().reshape(rows, inp // block, block)
    amax = xb.abs().amax(-1)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    codes = torch.round(xb * inv[..., None]).clamp_(-128, 127)
    return codes.reshape(rows, inp), amax / torch.tensor(127.0)


def reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """``linear`` in float64 from the codes and scales: the activations quantised as the kernel does,
    then exact block sums, scaled and summed in block order (the tests' oracle)."""
    xq, xs = quantize_rows(x, block)
    rows, inp = x.shape
    out, blocks = q.shape[0], inp // block
    sums = torch.einsum(
        "rbk,obk->rob", xq.double().reshape(rows, blocks, block), q.double().reshape(out, blocks, block)
    )
    return (sums * scale.double()[None] * xs.double()[:, None]).sum(-1)
