"""The ``int4`` trunk's decode step in one C++ call: every layer, norms to residuals, in ``int4_gemv.cpp``.

At one row a step's 4-bit weights stream in ~4 ms (``kernels.int4_gemv``), but the same step run as torch
ops took ~9.4 ms (Zen 5, one thread): ~15 ops a layer around the four matmuls (norms, rotary, the cache
writes, SwiGLU, residual adds), 300 a step, each paying the dispatcher and the interpreter (``profile``:
3.4 ms of the step was Python alone). ``decode_layers`` runs the same step from one call: the matmuls on
the GEMV's functions, attention on ``decode_attention``'s op, the norms and SiLU as the same ATen calls,
the rest as plain loops in the same order. Its result is ``GPT.decode``'s to the bit (tested), so it is
batch-invariant as that is, and nothing about quality changes.

Where it runs: the ``int4`` precision where both C++ ops load (AVX-512 VNNI, a compiler), over a bf16 or
int8 KV cache (the C++ attention's); elsewhere ``GPT.decode`` runs its torch ops as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import decode_attention, int4_gemv

NARROW_ROWS = 8
"""A step this narrow reads each weight once (the GEMV's rows per pass): bound by memory, not compute."""

ROW_BLOCK = 128
"""A wider call (packed prompts through ``run``) runs each matmul on this many rows at a time: x and the
outputs stay in cache, and the GEMV takes its tile runs (no bit changes: rows are independent)."""


@dataclass(frozen=True, slots=True)
class Int4Layer:
    """One decoder layer's weights as the C++ step takes them (fused projections on ``int4_gemv``)."""

    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    qkv: int4_gemv.Int4GemvWeight
    o: int4_gemv.Int4GemvWeight
    gate_up: int4_gemv.Int4GemvWeight
    down: int4_gemv.Int4GemvWeight


@dataclass(frozen=True, slots=True)
class Int4Decode:
    """Every layer's weights, stacked once for ``decode_layers``; ``run`` is one decode step's trunk."""

    norms: torch.Tensor  # [layers, 2, hidden] fp32: input and post-attention RMSNorm weights
    blobs: tuple[torch.Tensor, ...]  # per layer: qkv, o, gate_up, down packed streams
    blocks: tuple[int, int, int, int]
    bf16_scales: bool
    intermediate: int
    heads: int
    kv_heads: int
    eps: float
    final_norm: torch.Tensor | None = None
    """The model's final RMSNorm weight (fp32 [hidden]), applied by the step itself (``run(normed=True)``):
    its C++ norm gives ``F.rms_norm``'s bits, and a one-row step saves a dispatched norm (~0.09 ms cold,
    after the weights' stream). None: the caller applies the norm."""
    narrow_threads: int = 0
    """Threads for a step of at most ``NARROW_ROWS`` rows (0: torch's count). The runner sets 1 where the
    audio stage runs on the other core (``--audio-overlap``): two OpenMP teams on two cores stall each
    other at every barrier, and the GEMV has ~80 a step (one stream, Zen 5, 2 threads: RTF 0.69 with the
    trunk's narrow steps on both cores, 0.46 with them on one; BENCHMARKS.md)."""

    def shares_cores(self, rows: int) -> bool:
        """Whether a step of ``rows`` leaves the other core to the audio worker: a narrow step kept to one
        thread (``narrow_threads``). A wider one runs on every thread, and audio beside it would contend for
        a core at each of its barriers (32 streams, 150 tokens, Zen 5: the step 29 ms alone, 51 ms with the
        audio overlapped; BENCHMARKS.md)."""
        return self.narrow_threads > 0 and rows <= NARROW_ROWS

    @staticmethod
    def build(
        layers: list[Int4Layer], heads: int, kv_heads: int, eps: float, final_norm: torch.Tensor | None = None
    ) -> Int4Decode | None:
        """None where the step cannot run here (no C++ GEMV: the weights are dense; or mixed layouts).
        ``final_norm``: the model's final norm weight (eps ``eps``), kept where it is fp32."""
        if not layers or not int4_gemv.available():
            return None
        first = layers[0]
        weights = [w for layer in layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        blocks = (first.qkv.block, first.o.block, first.gate_up.block, first.down.block)
        same = all(
            (layer.qkv.block, layer.o.block, layer.gate_up.block, layer.down.block) == blocks for layer in layers
        )
        if not same or any(w.dense is not None or w.bf16_scales != first.qkv.bf16_scales for w in weights):
            return None
        norms = torch.stack(
            [torch.stack([layer.input_norm.detach(), layer.post_attention_norm.detach()]) for layer in layers]
        )
        if norms.dtype != torch.float32:
            return None
        return Int4Decode(
            norms.contiguous(),
            tuple(w.blob for w in weights),
            blocks,
            first.qkv.bf16_scales,
            first.gate_up.out_features // 2,
            heads,
            kv_heads,
            eps,
            final_norm.detach().contiguous() if final_norm is not None and final_norm.dtype == torch.float32 else None,
        )

    def applies(self, k_cache: torch.Tensor) -> bool:
        """The cache is one the C++ attention reads (bf16 or int8, on a CPU where its op runs)."""
        return decode_attention.applies(k_cache[0])

    def run(
        self,
        h: torch.Tensor,  # [rows, hidden] fp32; rows past len(slots) are padding
        cos: torch.Tensor,  # [rows, head_dim] fp32
        sin: torch.Tensor,
        k_cache: torch.Tensor,  # [layers, slots, kv_heads, positions, head_dim] bf16 or int8
        v_cache: torch.Tensor,
        scales: tuple[torch.Tensor, torch.Tensor] | None,  # int8: [layers, slots, kv_heads, positions] each
        slots: torch.Tensor,  # [n] int64
        positions: torch.Tensor,  # [n] int64: where each row's key and value go; it attends to 0..there
        normed: bool = False,
        keep: torch.Tensor | None = None,  # [k] int64: real rows whose output is wanted (None: every row)
    ) -> torch.Tensor:
        """The residual stream after every layer, each row's key and value written; with ``normed``, through
        the final norm (``final_norm``, which must be set). With ``keep``, only those rows' (in its order): the
        last layer's attention, o projection and MLP run on them alone (a prefill's last rows), with the bits
        they get when every row runs."""
        if normed and self.final_norm is None:
            raise ValueError("normed=True needs the step's final_norm")
        ks, vs = scales if scales is not None else (None, None)
        return torch.ops.chattts_int4_gemv.decode_layers(
            h.float().contiguous(),
            self.norms,
            self.eps,
            list(self.blobs),
            list(self.blocks),
            self.bf16_scales,
            self.intermediate,
            cos.float().contiguous(),
            sin.float().contiguous(),
            k_cache,
            v_cache,
            ks,
            vs,
            slots,
            positions,
            self.heads,
            self.kv_heads,
            int4_gemv.prefetch_distance(),
            self.narrow_threads if h.shape[0] <= NARROW_ROWS else 0,
            ROW_BLOCK,
            self.final_norm if normed else None,
            keep,
        )
