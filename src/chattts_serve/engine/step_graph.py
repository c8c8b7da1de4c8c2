"""The whole code decode step as one CUDA graph: embed -> trunk -> code heads -> sampling -> slot state.

Why: with only the trunk captured (``cuda_graph.StaticDecoder``), a step still issues ~140 sampling
launches one by one from Python, about 2.5 ms of host time per step: more than an H200 needs for the
whole step at small batches, where one stream's first chunk waits on several such steps. Captured, a
steady code decode step is one replay plus three small launches (the step's tokens and hidden rows
gathered by slot, the copy back) and the Python that reads the tokens.

What it takes: decode steps of code sequences only, with no admission (the step that runs while audio
is generated), in the static decode mode with counter noise: the CUDA defaults. Every other step (an
admission, a text sequence), and every step on a CPU unless ``step_graphs`` is "on", runs as before.
On a CPU "on" runs the same function eagerly: the tests compare it with the ordinary step there.

The function reads only device buffers whose addresses never change. Rows are slots ``0..bs-1`` (as
in the static trunk step); ``active`` marks the rows that decode this step (rewritten when the running
set changes: two launches); positions come from the slot state; a row that is not active sends its
keys to the scratch position and writes its sampling state back unchanged
(``SlotState.record_active``). Top-k reads its k-th value from a ``topk`` as wide as the vocabulary:
the same value as the eager step's narrower one, with no host value in a shape.

One graph per (batch, context) bucket, captured the first time a step needs it (most of the 180
buckets of 512 slots never occur under a given load; capturing them all would double the trunk
graphs' start-up), then checked at once on that live step: the mutable slot state is saved, the eager
function runs, the state is put back, the graph replays, and the tokens and state must equal the
eager step's (the hidden state within ``cuda_graph._TOLERANCE``) before the replay's result is used.
Keys written twice are the same keys (same inputs, same position). A graph that fails is dropped (or,
``strict_cuda_graphs``, raises) and its bucket runs eagerly from then on, with the eager result used.
All step graphs share one memory pool: they replay one at a time on one stream, and every graph's
outputs stay alive, so no capture reuses another graph's output memory.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from .cuda_graph import _TOLERANCE, _bucket

if TYPE_CHECKING:
    from .runner import ModelRunner
    from .step_plan import StepPlan

logger = logging.getLogger(__name__)

_MUTABLE = ("last", "generated", "history")
"""The slot state a step writes (``SlotState.record_active``)."""


def step_graphs_apply(mode: str, device_type: str, decode_mode: str, noise_source: str, cuda_graphs: bool) -> bool:
    """Whether the runner routes code decode steps through ``StepGraph``: "auto" where the trunk is
    captured anyway (CUDA, static decode, graphs on) and the noise needs no host (counter); "on"
    wherever the step is static with counter noise (eagerly where there is no CUDA); "off" never."""
    possible = decode_mode == "static" and noise_source == "counter"
    if mode == "on":
        if not possible:
            raise ValueError("step_graphs on needs decode static and sampling_noise counter")
        return True
    return mode == "auto" and possible and cuda_graphs and device_type == "cuda"


class StepGraph:
    """See the module docstring. ``runner`` owns the model, the static trunk step and the slot state."""

    def __init__(self, runner: ModelRunner, use_graphs: bool, strict: bool = False) -> None:
        static = runner.static
        assert static is not None, "the whole-step graph needs the static decode step"
        self.runner, self.static = runner, static
        self.device = static.device
        slots = runner.cache.num_slots
        self.active = torch.zeros(slots, dtype=torch.bool, device=self.device)
        self.rows = torch.arange(slots, device=self.device)
        self.use_graphs = use_graphs and self.device.type == "cuda"
        self.strict = strict
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.refused: set[tuple[int, int]] = set()
        self._pool = None
        self._active_for: StepPlan | None = None
        self.graph_replays = 0
        """Steps run by replaying a whole-step graph."""
        self.eager_steps = 0
        """Steps run by the same function eagerly (no CUDA, a refused bucket)."""
        self.captures = 0
        self.capture_s = 0.0
        """Time spent capturing and checking graphs, in all (each bucket once, at its first step)."""

    # ------------------------------------------------------------------ the function

    def step_fn(self, bs: int, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One code decode step of slots ``0..bs-1`` (attention over ``ctx`` positions): tokens
        ``[bs * num_vq]`` and final hidden states ``[bs, hidden]`` fp32. Only device buffers in."""
        r, st, static = self.runner, self.runner.slot_state, self.static
        active, rows = self.active[:bs], self.rows[:bs]
        pos = st.prompt_len[:bs] + st.generated[:bs] - 1
        static.pos[:bs].copy_(torch.where(active, pos, static.scratch))
        # A row that is not active may hold anything (a text id, a freed slot's last token): embed 0.
        codes = torch.where(active[:, None], st.last[:bs], 0)
        static.emb[:bs].copy_(r.model.embed.embed_codes(codes))
        h = static.fn(static.emb[:bs], r.cache, static.pos[:bs], ctx).float()
        logits = r._heads("code", h, rows, bs)
        tokens = r.sample_slots("code", rows, bs, r.num_vq, r._vocab["code"], logits, active=active)
        return tokens, h

    # ------------------------------------------------------------------ one step

    def applies(self, plan: StepPlan) -> bool:
        """A decode step of code sequences only, with no admission."""
        return not plan.had_prefill and len(plan.kinds) == 1 and plan.kinds[0].kind == "code"

    @torch.inference_mode()
    def run(self, plan: StepPlan, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The step for ``plan`` (``applies``), its longest sequence at cache length ``max_len``: the
        decode rows' tokens ``[n * num_vq]`` (decode order) and hidden states ``[n, hidden]``."""
        if max_len >= self.static.scratch:
            raise ValueError(f"position {max_len} exceeds cache {self.static.scratch}")
        assert plan.dec_slots is not None
        if self._active_for is not plan:  # the running set changed: mark its rows
            self.active.zero_()
            self.active.index_fill_(0, plan.dec_slots, True)
            self._active_for = plan
        bs = _bucket(self.static.batch_sizes, plan.max_slot + 1)
        ctx = _bucket(self.static.ctx_sizes, max_len + 1)
        key = (bs, ctx)
        with self.static._on_device():
            if key in self.graphs:
                graph, (tokens, h) = self.graphs[key]
                graph.replay()
                self.graph_replays += 1
            elif self.use_graphs and key not in self.refused:
                tokens, h = self._capture_and_check(bs, ctx)
            else:
                tokens, h = self.step_fn(bs, ctx)
                self.eager_steps += 1
        q = self.runner.num_vq
        return tokens.view(bs, q).index_select(0, plan.dec_slots).view(-1), h.index_select(0, plan.dec_slots)

    # ------------------------------------------------------------------ capture

    def _save(self) -> dict[str, torch.Tensor]:
        st = self.runner.slot_state
        return {name: getattr(st, name).clone() for name in _MUTABLE}

    def _restore(self, saved: dict[str, torch.Tensor]) -> None:
        st = self.runner.slot_state
        for name, value in saved.items():
            getattr(st, name).copy_(value)

    def _capture_and_check(self, bs: int, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Capture bucket (bs, ctx) on this live step, check it against the eager function, and return
        this step's result (the replay's, or the eager one's if the graph is refused). The step's state
        advances exactly once."""
        t0 = time.perf_counter()
        before = self._save()
        main = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up (lazy init, cuBLAS handles, compile), state put back each time
                self.step_fn(bs, ctx)
                self._restore(before)
        main.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._pool, stream=side):
            out_tokens, out_h = self.step_fn(bs, ctx)
        main.wait_stream(side)
        self._restore(before)  # a capture runs nothing on CUDA; a stand-in graph (tests) may have

        want_tokens, want_h = (t.clone() for t in self.step_fn(bs, ctx))
        after = self._save()
        self._restore(before)
        out_tokens.fill_(-1)
        out_h.fill_(float("nan"))
        graph.replay()
        rtol, atol = _TOLERANCE.get(self.static.emb.dtype, (1e-5, 1e-5))
        state_ok = all(torch.equal(getattr(self.runner.slot_state, n), after[n]) for n in _MUTABLE)
        ok = (
            state_ok
            and torch.equal(out_tokens, want_tokens)
            and bool(torch.allclose(out_h, want_h, rtol=rtol, atol=atol))
        )
        self.captures += 1
        self.capture_s += time.perf_counter() - t0
        if ok:
            self.graphs[(bs, ctx)] = (graph, (out_tokens, out_h))
            self.graph_replays += 1
            logger.debug("captured the decode step graph for batch %d ctx %d", bs, ctx)
            return out_tokens, out_h
        self.refused.add((bs, ctx))
        # The failed replay may have written wrong keys at this step's positions: the eager step again
        # (from the saved state) writes the right ones and leaves the state one step on.
        self._restore(before)
        want_tokens, want_h = self.step_fn(bs, ctx)
        msg = f"the decode step graph for batch {bs} ctx {ctx} on {self.device} differs from the eager step"
        if self.strict:
            raise RuntimeError(msg)
        logger.warning("%s; that bucket runs eagerly", msg)
        self.eager_steps += 1
        return want_tokens, want_h
