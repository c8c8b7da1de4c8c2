"""The static decode step: every running sequence decoded by ``GPT.decode_static`` with row b = KV slot
b, fixed-size input buffers, and (on CUDA) one captured CUDA graph per (batch bucket, context bucket).

Why this shape (nano-vllm's, adapted): a CUDA graph replays fixed kernels on fixed addresses, so the
step must take no host values and allocate nothing. Rows are slots, so the attention reads the cache
through a view (no gather); a batch bucket covers slots ``0..bs-1`` and rows whose slot decodes
nothing this step point at a scratch cache position (``max_len``) that nothing reads. The context
bucket bounds how many cache positions attention scans (256, 512, 1024, ... max_len), so short
sequences do not pay for the longest possible one. Graphs are captured at start-up, largest first,
into one shared memory pool; a shape without a graph (or no CUDA) runs the same function eagerly.
"""

from __future__ import annotations

import logging

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


class StaticDecoder:
    def __init__(self, gpt: GPT, cache: KVCache, use_graphs: bool, compile: bool = False) -> None:
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
        self.use_graphs = use_graphs and self.device.type == "cuda"
        if self.use_graphs:
            self.capture_all()

    @torch.inference_mode()
    def capture_all(self) -> None:
        """One graph per (batch, ctx) bucket, largest first, sharing one memory pool. Every row points
        at the scratch position while capturing, so no sequence's cache is touched."""
        self.pos.fill_(self.scratch)
        pool = None
        for bs in reversed(self.batch_sizes):
            for ctx in reversed(self.ctx_sizes):
                args = (self.emb[:bs], self.cache, self.pos[:bs], ctx)
                side = torch.cuda.Stream(self.device)
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    for _ in range(2):  # warm-up: lazy init, autotuning, compile
                        self.fn(*args)
                torch.cuda.current_stream(self.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self.fn(*args)
                pool = graph.pool()
                self.graphs[(bs, ctx)] = (graph, out)
        torch.cuda.synchronize(self.device)
        logger.info("captured %d CUDA graphs for decode", len(self.graphs))

    @torch.inference_mode()
    def __call__(self, emb_rows: torch.Tensor, slots: list[int], lengths: list[int]) -> torch.Tensor:
        """emb_rows [n, hidden] of sequences in ``slots`` at cache positions ``lengths`` -> [n, hidden]."""
        if max(lengths) >= self.scratch:
            raise ValueError(f"position {max(lengths)} exceeds cache {self.scratch}")
        bs = _bucket(self.batch_sizes, max(slots) + 1)
        ctx = _bucket(self.ctx_sizes, max(lengths) + 1)
        pin = self.device.type == "cuda"
        idx = torch.tensor(slots, dtype=torch.long, pin_memory=pin).to(self.device, non_blocking=pin)
        pos = torch.tensor(lengths, dtype=torch.long, pin_memory=pin).to(self.device, non_blocking=pin)
        self.pos[:bs].fill_(self.scratch)
        self.pos[idx] = pos
        self.emb[idx] = emb_rows.to(self.emb.dtype)
        entry = self.graphs.get((bs, ctx))
        if entry is not None:
            entry[0].replay()
            out = entry[1]
        else:
            out = self.fn(self.emb[:bs], self.cache, self.pos[:bs], ctx)
        return out[idx]
