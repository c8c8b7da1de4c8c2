"""The static decode step: every running sequence decoded by ``GPT.decode_static`` with row b = KV slot
b, fixed-size input buffers, and (on CUDA) one captured CUDA graph per (batch bucket, context bucket).

Why this shape (nano-vllm's, adapted): a CUDA graph replays fixed kernels on fixed addresses, so the
step must take no host values and allocate nothing. Rows are slots, so the attention reads the cache
through a view (no gather); a batch bucket covers slots ``0..bs-1`` and rows whose slot decodes
nothing this step point at a scratch cache position (``max_len``) that nothing reads. The context
bucket bounds how many cache positions attention scans (256, 512, 1024, ... max_len), so short
sequences do not pay for the longest possible one. Graphs are captured at start-up, largest first,
into one shared memory pool on one capture stream (``GraphStore``, the engine's one owner of its graphs);
a shape without a graph (or no CUDA) runs the same function eagerly.

Device: torch captures on a stream of the *current* device and replays on the current device's
stream, and the current device is per thread (0 unless set). So capture and replay both run inside
``torch.cuda.device(self.device)``, capture on the engine's capture stream of that device (``GraphStore``;
every torch.cuda call names the device, see ``chattts_serve.device``): an engine on ``cuda:1``
(or any worker after the first of ``--devices``) would otherwise record on the wrong card, and an
empty graph replays its capture-time output: garbage codes, no error. Every captured graph is checked
once against an eager step (``graph_matches_eager``); one that differs is not used.

``torch.compile`` (``compile_step``) traces the step with the batch and context sizes symbolic: one
compile serves every bucket (dynamo still specialises batch 1), where static shapes compiled once per
(batch, ctx) bucket, up to ~180 times at 256 slots. The start-up cost is logged.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from ..device import current_stream, host_zeros, new_stream, on_device, record_event
from ..models.chattts.gpt import GPT, KVCache

logger = logging.getLogger(__name__)


def batch_buckets(max_batch: int) -> list[int]:
    """Powers of two below ``max_batch``, then ``max_batch``: few enough (10 at 512 slots) to capture
    every bucket at start-up, at the cost of padding a batch up to twice its rows."""
    return doublings(max_batch)


def ctx_buckets(max_len: int, smallest: int = 256) -> list[int]:
    """Context lengths from ``smallest`` doubling, then ``max_len`` (the cache's end) itself."""
    return doublings(max_len, smallest)


def doublings(largest: int, smallest: int = 1, *, round_up: bool = False) -> list[int]:
    """``smallest`` doubled while below ``largest``, then ``largest`` itself or, with ``round_up``, the first
    doubling at or past it (every bucket then a power-of-two multiple of ``smallest``). Every bucket rule of
    the graphs (batch, context, a batch family's lengths) is this one."""
    sizes, n = [], smallest
    while n < largest:
        sizes.append(n)
        n *= 2
    return [*sizes, n if round_up else largest]


def _bucket(sizes: list[int], need: int) -> int:
    for s in sizes:
        if s >= need:
            return s
    raise ValueError(f"{need} exceeds the largest bucket {sizes[-1]}")


def compile_step(fn: Callable, backend: str | Callable = "inductor") -> Callable:
    """``torch.compile`` of the static step with every size symbolic (``dynamic=True``): the batch and
    context buckets share one compiled graph, plus one for batch 1 (sizes 0 and 1 are always
    specialised). The graphs are captured per bucket as before, each replaying the shared kernels."""
    return torch.compile(fn, dynamic=True, backend=backend)


def capture_graph(
    fn: Callable[[], Any], side: torch.cuda.Stream, pool: Any, between: Callable[[], None] | None = None
) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Warm ``fn`` up twice on the capture stream ``side`` (lazy init, cuBLAS handles, compile;
    ``between`` runs after each warm-up), then capture it on that stream into ``pool``: the graph and
    what the captured call returned (its static outputs). Call it under ``torch.cuda.device`` of the
    stream's device: torch captures and replays on the current device."""
    main = current_stream(side.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
            if between is not None:
                between()
    main.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # Thread-local capture mode: only this thread's unsafe calls (a sync, a cudaMalloc) break the capture,
    # not another thread's (the process-wide default would let any thread's call invalidate it).
    with torch.cuda.graph(graph, pool=pool, stream=side, capture_error_mode="thread_local"):
        out = fn()
    main.wait_stream(side)
    return graph, out


class GraphStore:
    """Every CUDA graph of one engine, the memory pool they share and the one stream they are captured on.

    Why one owner: a graph replays the cuBLAS workspace of the stream it was captured on (cuBLAS keys
    workspaces by (handle, stream)), so captures on streams drawn from torch's pool (32, handed out
    round robin) end up on the audio decode's stream, and a replay then shares its workspace with the
    audio matmuls running beside it. Here the capture stream is drawn once per engine
    (``device.new_stream``: never a stream another holder has, the audio stream included), the pool
    is made once, and graphs, refused ones included, live until ``close`` (or the store's end): a
    refused graph is not destroyed mid-serving. ``tables`` keeps each user's graphs by its own keys
    (the trunk's, the whole step's)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.tables: dict[str, dict[Any, tuple[torch.cuda.CUDAGraph, Any]]] = {}
        self.retired: list[torch.cuda.CUDAGraph] = []
        """Graphs that failed their self-check: never replayed, kept until ``close``."""
        self._stream: torch.cuda.Stream | None = None
        self._pool: Any = None

    def table(self, name: str) -> dict[Any, tuple[torch.cuda.CUDAGraph, Any]]:
        return self.tables.setdefault(name, {})

    @property
    def stream(self) -> torch.cuda.Stream:
        """The engine's capture stream (drawn at the first use)."""
        if self._stream is None:
            self._stream = new_stream(self.device)
        return self._stream

    def capture(
        self, fn: Callable[[], Any], between: Callable[[], None] | None = None
    ) -> tuple[torch.cuda.CUDAGraph, Any]:
        """``capture_graph`` on the engine's capture stream, into the engine's pool (under ``on_device``)."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return capture_graph(fn, self.stream, self._pool, between)

    def retire(self, graph: torch.cuda.CUDAGraph) -> None:
        self.retired.append(graph)

    def close(self) -> None:
        """Free every graph (their pool goes with the last of them); the engine captures no more."""
        for table in self.tables.values():
            table.clear()
        self.retired.clear()
        self._pool = None
        self._stream = None


def sdpa_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> str:
    """The kernel ``F.scaled_dot_product_attention`` picks for these inputs (torch's own choice
    function): "FLASH_ATTENTION" (on a CPU: torch's CPU flash kernel), "EFFICIENT_ATTENTION",
    "CUDNN_ATTENTION" or "MATH"."""
    from torch.nn.attention import SDPBackend

    choice = torch._fused_sdp_choice(q, k, v, mask, 0.0, False, scale=q.shape[-1] ** -0.5)
    return SDPBackend(choice).name


_TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 1e-3), torch.bfloat16: (1.6e-2, 1e-2)}
"""(rtol, atol) of a replay against the eager step: the same kernels should agree to the bit; this
leaves room for a different cuBLAS algorithm, and none for a graph that did not write (NaN) or that
returns another input's output."""


def graph_matches_eager(
    replay: Callable[[], None],
    out: torch.Tensor,
    eager: Callable[[], torch.Tensor],
    tolerance: tuple[float, float] | None = None,
) -> tuple[bool, float]:
    """Run ``eager`` (the step outside the graph, same inputs), poison the graph's static output
    ``out`` with NaN, ``replay`` and compare. Returns (equal within tolerance, max abs difference).
    ``tolerance``: (rtol, atol), where the output's dtype is not the one computed in (None: by ``out.dtype``)."""
    want = eager().clone()
    out.fill_(math.nan)
    replay()
    rtol, atol = tolerance if tolerance is not None else _TOLERANCE.get(out.dtype, (1e-5, 1e-5))
    ok = bool(torch.allclose(out, want, rtol=rtol, atol=atol))
    diff = (out.float() - want.float()).abs().nan_to_num(math.inf).max().item() if out.numel() else 0.0
    return ok, diff


class StaticDecoder:
    def __init__(
        self,
        gpt: GPT,
        cache: KVCache,
        use_graphs: bool,
        compile: bool = False,
        strict_graphs: bool = False,
        store: GraphStore | None = None,
        attention: str = "sdpa",
    ) -> None:
        """``strict_graphs``: a captured graph that fails its self-check raises (default: it is dropped,
        with one warning, and its shape runs eagerly). ``store``: the engine's graphs (its own if None).
        ``attention``: "sdpa" or "flex" (``ExecutionPlan.attention``)."""
        self.gpt, self.cache = gpt, cache
        self.device = cache.k.device
        self.store = store if store is not None else GraphStore(self.device)
        self.scratch = cache.max_len - 1  # the cache has one position more than any sequence uses
        slots = cache.num_slots
        hidden = gpt.cfg.hidden_size
        dtype = gpt.norm.weight.dtype
        self.emb = torch.zeros(slots, hidden, dtype=dtype, device=self.device)
        self.pos = torch.full((slots,), self.scratch, dtype=torch.long, device=self.device)
        self.batch_sizes = batch_buckets(slots)
        self.ctx_sizes = ctx_buckets(self.scratch)
        # Each row's own keys (FlexAttention) where the plan chose it, else the bucket under a mask
        # (``kernels.flex_decode``).
        self.attention = attention
        step = functools.partial(gpt.decode_static, attention=self.attention)
        self.fn = compile_step(step) if compile else step
        self.compiled = compile
        # Slots and positions reach the device through persistent pinned buffers (CUDA), not a
        # freshly pinned tensor per call; ``_copied`` orders a rewrite after the previous copy.
        self._pin = self.device.type == "cuda"
        self._host_idx = host_zeros(slots, torch.long, self.device)
        self._host_pos = host_zeros(slots, torch.long, self.device)
        self._dev_idx = torch.zeros(slots, dtype=torch.long, device=self.device)
        self._dev_pos = torch.zeros(slots, dtype=torch.long, device=self.device)
        self._copied: torch.cuda.Event | None = None
        self.attention_backend = self._log_attention_backend(gpt, cache)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = self.store.table("trunk")
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
        elif compile:
            self.warm_up()

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Without graphs of its own (CPU, graphs off, or the step graphs capturing the step later),
        a compiled step still compiles now, at start-up, not in the first request: batch 1 and the
        largest batch (the symbolic-size graph), every row at the scratch position."""
        t0 = time.perf_counter()
        with self._on_device():
            self.pos.fill_(self.scratch)
            for bs in sorted({1, self.batch_sizes[-1]}):
                self._eager(bs, self.ctx_sizes[0])
        logger.info("compiled the static decode step in %.1f s", time.perf_counter() - t0)

    def _log_attention_backend(self, gpt: GPT, cache: KVCache) -> str:
        """Which SDPA kernel the step's attention runs (logged once: flash, efficient, cuDNN or math)."""
        # One row: the choice depends on dtype, head size, the mask and alignment, not on the batch.
        cfg, ctx = gpt.cfg, self.ctx_sizes[0]
        dtype = torch.float32 if cache.quantized else cache.k.dtype  # an int8 cache is read dequantized
        q = torch.zeros(1, cfg.num_heads, 1, cfg.head_dim, dtype=dtype, device=self.device)
        k = torch.zeros(1, cfg.num_heads, ctx, cfg.head_dim, dtype=dtype, device=self.device)
        mask = torch.ones(1, 1, 1, ctx, dtype=torch.bool, device=self.device)
        try:
            name = sdpa_backend(q, k, k, mask)
        except (RuntimeError, AttributeError, ValueError) as exc:  # a private torch function: may move
            name = f"unknown ({exc})"
        where = "torch's CPU flash kernel" if self.device.type == "cpu" and name == "FLASH_ATTENTION" else name
        if self.attention == "flex":
            where = f"none (FlexAttention, each row's own length; {name} where the step falls back)"
        logger.info("decode attention on %s (%s): SDPA backend %s", self.device, cache.k.dtype, where)
        return name

    def _on_device(self) -> AbstractContextManager:
        """The engine's CUDA device as the current one (capture and replay use the current device)."""
        return on_device(self.device)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """One graph per (batch, ctx) bucket, largest first, sharing one memory pool, each checked once
        against an eager step. Every row points at the scratch position while capturing and checking,
        so no sequence's cache is touched."""
        t0 = time.perf_counter()
        with self._on_device():
            self.pos.fill_(self.scratch)
            for bs in reversed(self.batch_sizes):
                for ctx in reversed(self.ctx_sizes):
                    self.graphs[(bs, ctx)] = self._capture(bs, ctx)
            torch.cuda.synchronize(self.device)
            self.check_graphs()
        logger.info(
            "captured %d CUDA graphs for decode (%d refused) in %.1f s%s",
            len(self.graphs),
            self.graphs_refused,
            time.perf_counter() - t0,
            ", torch.compile included (one symbolic-shape compile, plus batch 1)" if self.compiled else "",
        )

    def _capture(self, bs: int, ctx: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up, then capture one bucket on the engine's capture stream (under ``_on_device``)."""
        args = (self.emb[:bs], self.cache, self.pos[:bs], ctx)
        return self.store.capture(lambda: self.fn(*args))

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
                self.store.retire(self.graphs.pop((bs, ctx))[0])
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
        idx, pos = self._upload(slots, lengths)
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

    def _upload(self, slots: list[int], lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``slots`` and ``lengths`` as device tensors: on CUDA written into the persistent pinned
        buffers and copied without blocking (after the previous copy from them is done: a rewrite
        while it is pending would change what it reads)."""
        n = len(slots)
        if not self._pin:
            return torch.tensor(slots, dtype=torch.long), torch.tensor(lengths, dtype=torch.long)
        if self._copied is not None:
            self._copied.synchronize()  # done long ago in practice: each step waits for its tokens
        self._host_idx.numpy()[:n] = slots
        self._host_pos.numpy()[:n] = lengths
        idx = self._dev_idx[:n]
        pos = self._dev_pos[:n]
        idx.copy_(self._host_idx[:n], non_blocking=True)
        pos.copy_(self._host_pos[:n], non_blocking=True)
        self._copied = record_event(self.device)
        return idx, pos
