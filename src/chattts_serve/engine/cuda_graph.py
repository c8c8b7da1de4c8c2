"""The static decode step: every running sequence decoded by ``GPT.decode_static`` with row b = KV slot
b, fixed-size input buffers, and (on CUDA) one captured CUDA graph per (batch bucket, context bucket).

Why this shape (nano-vllm's, adapted): a CUDA graph replays fixed kernels on fixed addresses, so the
step must take no host values and allocate nothing. Rows are slots, so the attention reads the cache
through a view (no gather); a batch bucket covers slots ``0..bs-1`` and rows whose slot decodes
nothing this step point at a scratch cache position (``max_len``) that nothing reads. The context
bucket bounds how many cache positions attention scans (256, 512, 1024, ... max_len), so short
sequences do not pay for the longest possible one. Graphs are captured at start-up, largest first,
into one shared memory pool; a shape without a graph (or no CUDA) runs the same function eagerly.

Device: torch captures on a stream of the *current* device and replays on the current device's
stream, and the current device is per thread (0 unless set). So capture and replay both run inside
``torch.cuda.device(self.device)``, capture on a side stream of that device: an engine on ``cuda:1``
(or any worker after the first of ``--devices``) would otherwise record on the wrong card, and an
empty graph replays its capture-time output: garbage codes, no error. Every captured graph is checked
once against an eager step (``graph_matches_eager``); one that differs is not used.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch

from ..model.gpt import GPT, KVCache

logger = logging.getLogger(__name__)


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 16 (as nano-vllm), always ending at ``max_batch``."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sizes + [max_batch]


def ctx_buckets(max_len: int, smallest: int = 256) -> list[int]:
    sizes, c = [], smallest
    while c < max_len:
        sizes.append(c)
        c *= 2
    return sizes + [max_len]


def _bucket(sizes: list[int], need: int) -> int:
    for s in sizes:
        if s >= need:
            return s
    raise ValueError(f"{need} exceeds the largest bucket {sizes[-1]}")


_TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 1e-3), torch.bfloat16: (1.6e-2, 1e-2)}
"""(rtol, atol) of a replay against the eager step: the same kernels should agree to the bit; this
leaves room for a different cuBLAS algorithm, and none for a graph that did not write (NaN) or that
returns another input's output."""


def graph_matches_eager(
    replay: Callable[[], None], out: torch.Tensor, eager: Callable[[], torch.Tensor]
) -> tuple[bool, float]:
    """Run ``eager`` (the step outside the graph, same inputs), poison the graph's static output
    ``out`` with NaN, ``replay`` and compare. Returns (equal within tolerance, max abs difference)."""
    want = eager().clone()
    out.fill_(math.nan)
    replay()
    rtol, atol = _TOLERANCE.get(out.dtype, (1e-5, 1e-5))
    ok = bool(torch.allclose(out, want, rtol=rtol, atol=atol))
    diff = (out.float() - want.float()).abs().nan_to_num(math.inf).max().item() if out.numel() else 0.0
    return ok, diff


class StaticDecoder:
    def __init__(
        self, gpt: GPT, cache: KVCache, use_graphs: bool, compile: bool = False, strict_graphs: bool = False
    ) -> None:
        """``strict_graphs``: a captured graph that fails its self-check raises (default: it is dropped,
        with one warning, and its shape runs eagerly)."""
        self.gpt, self.cache = gpt, cache
        self.device = cache.k.device
        self.scratch = cache.max_len - 1  # the cache has one position more than any sequence uses
        slots = cache.num_slots
        hidden = gpt.cfg.hidden_size
        dtype = gpt.norm.weight.dtype
        self.emb = torch.zeros(slots, hidden, dtype=dtype, device=self.device)
        self.pos = torch.full((slots,), self.scratch, dtype=torch.long, device=self.device)
        self.batch_sizes = batch_buckets(slots)
        self.ctx_sizes = ctx_buckets(self.scratch)
        self.fn = gpt.decode_static
        if compile:
            import torch._dynamo as dynamo

            # One specialisation per (batch, ctx) bucket; dynamo's default limit (8) would fall back to eager.
            n_shapes = len(self.batch_sizes) * len(self.ctx_sizes)
            dynamo.config.cache_size_limit = max(dynamo.config.cache_size_limit, n_shapes + 8)
            self.fn = torch.compile(gpt.decode_static, dynamic=False)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.strict_graphs = strict_graphs
        self.graph_replays = 0
        """Steps run by replaying a graph."""
        self.eager_steps = 0
        """Steps run eagerly: no graphs (CPU, ``cuda_graphs`` off), a shape without one, or a refused one."""
        self.graphs_refused = 0
        """Captured graphs that failed their self-check (their shapes run eagerly)."""
        self.use_graphs = use_graphs and self.device.type == "cuda"
        if self.use_graphs:
            self.capture_all()

    def _on_device(self) -> AbstractContextManager:
        """The engine's CUDA device as the current one (capture and replay use the current device)."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else nullcontext()

    @torch.inference_mode()
    def capture_all(self) -> None:
        """One graph per (batch, ctx) bucket, largest first, sharing one memory pool, each checked once
        against an eager step. Every row points at the scratch position while capturing and checking,
        so no sequence's cache is touched."""
        with self._on_device():
            self.pos.fill_(self.scratch)
            pool = None
            for bs in reversed(self.batch_sizes):
                for ctx in reversed(self.ctx_sizes):
                    graph, out = self._capture(bs, ctx, pool)
                    pool = graph.pool()
                    self.graphs[(bs, ctx)] = (graph, out)
            torch.cuda.synchronize(self.device)
            self.check_graphs()
        logger.info("captured %d CUDA graphs for decode (%d refused)", len(self.graphs), self.graphs_refused)

    def _capture(self, bs: int, ctx: int, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up, then capture one bucket on a side stream of the engine's device (under ``_on_device``)."""
        args = (self.emb[:bs], self.cache, self.pos[:bs], ctx)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up: lazy init, autotuning, compile
                self.fn(*args)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=side):
            out = self.fn(*args)
        torch.cuda.current_stream(self.device).wait_stream(side)
        return graph, out

    @torch.inference_mode()
    def check_graphs(self) -> None:
        """Replay every graph once on inputs unlike the capture's and compare with the eager step; drop
        (or, ``strict_graphs``, raise on) any that differs. Rows stay at the scratch position."""
        gen = torch.Generator(device="cpu").manual_seed(0)
        probe = torch.randn(self.emb.shape, generator=gen).to(self.device, self.emb.dtype)
        bad = []
        for (bs, ctx), (graph, out) in list(self.graphs.items()):
            self.emb.copy_(probe)
            self.pos[:bs].fill_(self.scratch)
            ok, diff = graph_matches_eager(graph.replay, out, lambda bs=bs, ctx=ctx: self._eager(bs, ctx))
            if not ok:
                bad.append(f"batch {bs} ctx {ctx} (max diff {diff:.3g})")
                del self.graphs[(bs, ctx)]
        self.emb.zero_()
        self.graphs_refused += len(bad)
        if bad:
            msg = f"{len(bad)} CUDA graph(s) on {self.device} differ from the eager step: " + ", ".join(bad)
            if self.strict_graphs:
                raise RuntimeError(msg)
            logger.warning("%s; those shapes run eagerly", msg)

    def _eager(self, bs: int, ctx: int) -> torch.Tensor:
        return self.fn(self.emb[:bs], self.cache, self.pos[:bs], ctx)

    @torch.inference_mode()
    def __call__(self, emb_rows: torch.Tensor, slots: list[int], lengths: list[int]) -> torch.Tensor:
        """emb_rows [n, hidden] of sequences in ``slots`` at cache positions ``lengths`` -> [n, hidden]."""
        dev = self.emb.device
        pin = dev.type == "cuda"
        idx = torch.tensor(slots, dtype=torch.long, pin_memory=pin).to(dev, non_blocking=pin)
        pos = torch.tensor(lengths, dtype=torch.long, pin_memory=pin).to(dev, non_blocking=pin)
        return self.run(emb_rows, idx, pos, max(slots), max(lengths))

    @torch.inference_mode()
    def run(
        self, emb_rows: torch.Tensor, idx: torch.Tensor, pos: torch.Tensor, max_slot: int, max_len: int
    ) -> torch.Tensor:
        """``__call__`` with the slots ``idx`` and positions ``pos`` already on the device (the runner
        keeps them there) and their maxima from the host: nothing is read back."""
        if max_len >= self.scratch:
            raise ValueError(f"position {max_len} exceeds cache {self.scratch}")
        bs = _bucket(self.batch_sizes, max_slot + 1)
        ctx = _bucket(self.ctx_sizes, max_len + 1)
        self.pos[:bs].fill_(self.scratch)
        self.pos[idx] = pos
        self.emb[idx] = emb_rows.to(self.emb.dtype)
        entry = self.graphs.get((bs, ctx))
        if entry is not None:
            with self._on_device():
                entry[0].replay()
            self.graph_replays += 1
            out = entry[1]
        else:
            out = self._eager(bs, ctx)
            self.eager_steps += 1
        return out[idx]
