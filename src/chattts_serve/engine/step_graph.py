"""The "step-graph" decode path (the CUDA default): embed -> trunk -> heads -> sampling -> slot state as one
CUDA graph (``engine.decode_path``).

Why: with only the trunk captured (``cuda_graph.StaticDecoder``), a step still issues ~140 sampling
launches per kind one by one from Python, about 2.5 ms of host time per step: more than an H200 needs
for the whole step at small batches, where one stream's first chunk waits on several such steps.
Captured, a decode step is one replay plus a few small launches (each kind's tokens and the code rows'
hidden states gathered by slot, the copy back) and the Python that reads the tokens.

What it takes: every step with decode rows, in the static decode mode with counter noise (the CUDA
defaults). Text rows (the refine pass) ride in the same graph (a second variant per bucket: text
head and text sampling over the bucket's rows). A step's admissions are prefilled and sampled eagerly
first, as before, and left alone by the graph. On a CPU the plan picks this path only when
``step_graphs`` is "on", and then runs the same function eagerly (the tests compare it with the ordinary
step there).

The function reads only device buffers whose addresses never change. Rows are slots ``0..bs-1`` (as
in the static trunk step); ``code_active`` / ``text_active`` mark the rows that decode each kind this
step (rewritten when the running set changes: four launches); positions come from the slot state; a
row that is not active sends its keys to the scratch position and writes its sampling state back
unchanged (``SlotState.record_active``). Top-k reads its k-th value from a ``topk`` as wide as the
vocabulary: the same value as the eager step's narrower one, with no host value in a shape.

One graph per (batch, context, text rows or not) bucket, every bucket captured at start-up
(``capture_all``; batch buckets are powers of two: 512 slots of 2304 positions make 10 x 5 x 2) and never on
the live path: a capture syncs the device, warms up twice and checks, 50-200 ms that would stall every
stream in flight. Each is checked at once on a probe step (every row of the bucket active, code rows
and, in the text variant, text rows, from random last tokens at position 0 of the still empty cache):
the mutable slot state is saved, the eager function runs, the state is put back, the graph replays,
and the tokens and state must equal the eager step's (the hidden state within
``cuda_graph._TOLERANCE``). A graph that fails is kept unused by the ``GraphStore`` (or,
``strict_cuda_graphs``, raises) and its bucket runs eagerly. The time and memory the capture took are
logged (``capture_s``, ``capture_bytes``). Captures use the thread-local capture mode: another
thread's CUDA call cannot invalidate them.
All step graphs share one memory pool and one capture stream (the engine's ``GraphStore``, which owns
them, refused ones included, until the engine goes): they replay one at a time on one stream, and every
graph's outputs stay alive, so no capture reuses another graph's output memory.
"""

from __future__ import annotations

import logging
import time

import torch

from .cuda_graph import _TOLERANCE, _bucket
from .decode_path import Decoded, DecodeStep, RunnerParts
from .decode_static import static_decoder
from .outputs import PrefillChunk
from .prefill_runner import Pieces, Prefiller, torch_prefill
from .step_plan import StepPlan

logger = logging.getLogger(__name__)

_MUTABLE = ("last", "generated", "history")
"""The slot state a step writes (``SlotState.record_active``)."""


class StepGraph:
    """See the module docstring. It keeps the runner's parts it uses (never the runner: no reference
    cycle, so an engine and its graphs go when it is dropped, not at a later garbage collection)."""

    name = "step-graph"

    def __init__(self, parts: RunnerParts) -> None:
        plan = parts.plan
        # Every decode step replays one of these graphs: the trunk's own graphs would never replay.
        static = static_decoder(parts, graphs=False)
        self.static = static
        self.embed, self.cache, self.slot_state = parts.model.embed, parts.cache, parts.slot_state
        self.heads, self.sampler = parts.heads, parts.sampler
        self.num_vq = self.heads.num_vq
        self.device = static.device
        slots = self.cache.num_slots
        self.code_active = torch.zeros(slots, dtype=torch.bool, device=self.device)
        self.text_active = torch.zeros(slots, dtype=torch.bool, device=self.device)
        self.rows = torch.arange(slots, device=self.device)
        self.use_graphs = plan.cuda_graphs and self.device.type == "cuda"
        self.strict = plan.strict_cuda_graphs
        self.store = static.store
        self.graphs: dict[tuple[int, int, bool], tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]] = (
            self.store.table("step")
        )
        """(batch bucket, context bucket, any text row) -> the graph and its outputs."""
        self.refused: set[tuple[int, int, bool]] = set()
        self._active_for: StepPlan | None = None
        self.graph_replays = 0
        """Steps run by replaying a step graph."""
        self.eager_steps = 0
        """Steps run by the same function eagerly (no CUDA, a refused bucket)."""
        self.capture_s = 0.0
        """Time spent capturing and checking every bucket's graph at start-up."""
        self.capture_bytes = 0
        """Device memory the capture took (the graphs' pool and outputs; CUDA's reserved bytes)."""
        if self.use_graphs:
            self.capture_all()

    # ------------------------------------------------------------------ the function

    def step_fn(self, bs: int, ctx: int, text: bool = False) -> tuple[torch.Tensor, ...]:
        """One decode step of slots ``0..bs-1`` (attention over ``ctx`` positions): code tokens
        ``[bs * num_vq]``, final hidden states ``[bs, hidden]`` fp32 and, ``text``, text tokens ``[bs]``.
        Only device buffers in: ``code_active`` / ``text_active`` say which rows decode which kind."""
        st, static, heads, vocab = self.slot_state, self.static, self.heads, self.heads.vocab
        code_on, rows = self.code_active[:bs], self.rows[:bs]
        pos = st.prompt_len[:bs] + st.generated[:bs] - 1
        # A row that is not active may hold anything (a text id, a freed slot's last token): embed 0.
        last = st.last[:bs]
        emb = self.embed.embed_codes(torch.where(code_on[:, None], last, 0))
        on = code_on
        if text:
            text_on = self.text_active[:bs]
            text_emb = self.embed.embed_text(torch.where(text_on, last[:, 0], 0))
            emb = torch.where(text_on[:, None], text_emb, emb)
            on = code_on | text_on
        static.pos[:bs].copy_(torch.where(on, pos, static.scratch))
        static.emb[:bs].copy_(emb)
        h = static.fn(static.emb[:bs], self.cache, static.pos[:bs], ctx).float()
        code_logits = heads.logits("code", h, rows, bs)
        code = self.sampler.sample_slots("code", rows, bs, self.num_vq, vocab["code"], code_logits, active=code_on)
        if not text:
            return code, h
        # After the code rows' record: each kind writes only its rows, the other's come back as they are.
        text_logits = heads.logits("text", h, rows, bs)
        return code, h, self.sampler.sample_slots("text", rows, bs, 1, vocab["text"], text_logits, active=text_on)

    # ------------------------------------------------------------------ one step

    def decode(self, step: DecodeStep) -> Decoded:
        """``DecodePath.decode``: the admissions' first tokens sampled eagerly (they are not in the graph's
        rows), then every decode row in the graph."""
        first: dict[str, torch.Tensor] = {}
        if step.first:
            with step.stage("sampling"):
                for k in step.plan.kinds:
                    if k.n_prefill:
                        first[k.kind] = self.sampler.sample_first(k, step.first[k.kind])
        decoded: dict[str, torch.Tensor] = {}
        hidden = None
        if step.seqs:
            with step.stage("decode"):
                decoded, hidden = self.run(step.plan, max(s.cache_len for s in step.seqs))
        tokens = []
        for k in step.plan.kinds:  # each kind: its admissions, then its decode rows (plan order)
            tokens += [t[k.kind] for t in (first, decoded) if k.kind in t]
        return Decoded(tokens, hidden)

    def prefill(self, prefiller: Prefiller, chunks: list[PrefillChunk], last_only: bool = False) -> Pieces:
        return torch_prefill(prefiller, chunks, last_only)

    def audio_beside(self, rows: int) -> bool:
        return True  # a CUDA graph: the audio has a stream of its own

    def counters(self) -> dict[str, int]:
        return {
            "step_graph_replays": self.graph_replays,
            "step_graph_eager_steps": self.eager_steps,
            "step_graphs_captured": len(self.graphs),
            "step_graphs_refused": len(self.refused),
        }

    @torch.inference_mode()
    def run(self, plan: StepPlan, max_len: int) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        """The decode rows of ``plan`` (any kinds; its admissions were sampled already and are left
        alone), the longest at cache length ``max_len``: each kind's decode tokens in its decode order
        (code ``[n * num_vq]``, text ``[n]``), and the code decode rows' hidden states ``[n, hidden]``."""
        if max_len >= self.static.scratch:
            raise ValueError(f"position {max_len} exceeds cache {self.static.scratch}")
        decoding = {k.kind: k for k in plan.kinds if k.n_decode}
        if self._active_for is not plan:  # the running set changed: mark its rows
            for kind, mask in (("code", self.code_active), ("text", self.text_active)):
                mask.zero_()
                if kind in decoding:
                    mask.index_fill_(0, decoding[kind].dec_slots, True)
            self._active_for = plan
        bs = _bucket(self.static.batch_sizes, plan.max_slot + 1)
        ctx = _bucket(self.static.ctx_sizes, max_len + 1)
        key = (bs, ctx, "text" in decoding)
        with self.static._on_device():
            if key in self.graphs:
                graph, out = self.graphs[key]
                graph.replay()
                self.graph_replays += 1
            else:  # no graphs, or a refused bucket: never a capture here (they all happen at start-up)
                out = self.step_fn(*key)
                self.eager_steps += 1
        tokens: dict[str, torch.Tensor] = {}
        hidden = None
        if "code" in decoding:
            slots = decoding["code"].dec_slots
            tokens["code"] = out[0].view(bs, self.num_vq).index_select(0, slots).view(-1)
            hidden = out[1].index_select(0, slots)
        if "text" in decoding:
            tokens["text"] = out[2].index_select(0, decoding["text"].dec_slots)
        return tokens, hidden

    # ------------------------------------------------------------------ capture

    def buckets(self) -> list[tuple[int, int, bool]]:
        """Every (batch, context, text rows) bucket a step can fall in, largest first (one memory pool:
        the largest capture's blocks serve the smaller ones)."""
        return [
            (bs, ctx, text)
            for bs in reversed(self.static.batch_sizes)
            for ctx in reversed(self.static.ctx_sizes)
            for text in (True, False)
        ]

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture and check every bucket's graph on a probe step (module docstring), then put the
        slot state and the masks back as they were (no sequence is running yet)."""
        st = self.slot_state
        t0 = time.perf_counter()
        saved = {name: getattr(st, name).clone() for name in (*_MUTABLE, "prompt_len")}
        cuda = self.device.type == "cuda"
        reserved = torch.cuda.memory_reserved(self.device) if cuda else 0
        gen = torch.Generator(device="cpu").manual_seed(0)
        vocab = min(self.heads.vocab.values())
        st.last.copy_(torch.randint(0, vocab, st.last.shape, generator=gen))
        st.prompt_len.fill_(1)  # position 0: nothing is cached yet, and the next prefill overwrites it
        probe = self._save()
        with self.static._on_device():
            for key in self.buckets():
                bs, _, text = key
                self.code_active.zero_(), self.text_active.zero_()
                self.code_active[:bs] = True
                if text:  # odd rows text, even rows code
                    self.code_active[1:bs:2] = False
                    self.text_active[1:bs:2] = True
                self._capture_and_check(key)
                self._restore(probe)
            if cuda:
                torch.cuda.synchronize(self.device)
                self.capture_bytes = torch.cuda.memory_reserved(self.device) - reserved
        for name, value in saved.items():
            getattr(st, name).copy_(value)
        self.code_active.zero_(), self.text_active.zero_()
        self._active_for = None
        self.graph_replays = self.eager_steps = 0
        self.capture_s = time.perf_counter() - t0
        logger.info(
            "captured %d decode step graphs (%d refused) on %s in %.1f s, %.0f MiB",
            len(self.graphs),
            len(self.refused),
            self.device,
            self.capture_s,
            self.capture_bytes / 2**20,
        )

    def _save(self) -> dict[str, torch.Tensor]:
        st = self.slot_state
        return {name: getattr(st, name).clone() for name in _MUTABLE}

    def _restore(self, saved: dict[str, torch.Tensor]) -> None:
        st = self.slot_state
        for name, value in saved.items():
            getattr(st, name).copy_(value)

    def _capture_and_check(self, key: tuple[int, int, bool]) -> tuple[torch.Tensor, ...]:
        """Capture bucket ``key`` on the probe step, check it against the eager function, and return
        the step's result (the replay's, or the eager one's if the graph is refused). The step's state
        advances exactly once."""
        before = self._save()
        # The warm-ups run the step for real: the state is put back after each.
        graph, out = self.store.capture(lambda: self.step_fn(*key), lambda: self._restore(before))
        self._restore(before)  # a capture runs nothing on CUDA; a stand-in graph (tests) may have

        want = tuple(t.clone() for t in self.step_fn(*key))
        after = self._save()
        self._restore(before)
        for t in out:
            t.fill_(float("nan") if t.is_floating_point() else -1)
        graph.replay()
        rtol, atol = _TOLERANCE.get(self.static.emb.dtype, (1e-5, 1e-5))
        state_ok = all(torch.equal(getattr(self.slot_state, n), after[n]) for n in _MUTABLE)
        tokens_ok = all(torch.equal(o, w) for o, w in zip(out, want, strict=True) if not o.is_floating_point())
        hidden_ok = bool(torch.allclose(out[1], want[1], rtol=rtol, atol=atol))
        if state_ok and tokens_ok and hidden_ok:
            self.graphs[key] = (graph, out)
            self.graph_replays += 1
            logger.debug("captured the decode step graph for batch %d ctx %d text %s", *key)
            return out
        self.refused.add(key)
        self.store.retire(graph)
        # The failed replay may have written wrong keys at this step's positions: the eager step again
        # (from the saved state) writes the right ones and leaves the state one step on.
        self._restore(before)
        want = self.step_fn(*key)
        bs, ctx, text = key
        rows = " with text rows" if text else ""
        msg = f"the decode step graph for batch {bs} ctx {ctx}{rows} on {self.device} differs from the eager step"
        if self.strict:
            raise RuntimeError(msg)
        logger.warning("%s; that bucket runs eagerly", msg)
        self.eager_steps += 1
        return want
