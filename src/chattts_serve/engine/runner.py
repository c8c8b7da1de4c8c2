"""The model runner: turns a ``SchedulerOutput`` into device work and a ``RunnerOutput``.

Prefill: each newly admitted sequence's prompt goes into its own slot, all of a step's prompts in as
few trunk calls as the mode allows, and their first logits from one heads call per kind where rows
are independent (``engine.prefill_runner``). A long prompt may go in chunks over several steps (chunked
prefill, ``engine.scheduler``): its sampling state is admitted, and its first token sampled, with its last.

Decode: all running sequences, text and code mixed, in one trunk call; heads and sampling per kind,
batched. How the trunk runs is the decode path (``engine.decode_path``: rows, static, step graph or ONNX
Runtime), picked once from the execution plan (``engine.plan``) through ``DECODE_PATHS``. Sampling state
lives on the device per KV slot (``engine.slot_state``): admission writes it, a step gathers it by slot
index and writes its tokens back (``engine.slot_sampler``), so host work and launches do not grow
with the batch (except the ``generator`` noise source's one draw per unseeded sequence, and the CPU
row-by-row attention). A step moves data between host and device at most twice: one staging copy in
(admissions and index tensors, none while the running set is unchanged) and one copy out (the sampled
tokens), which is the step's only wait on the device: ``launch`` queues the step (the decode path's
``decode``) and starts that copy, ``collect`` waits for it, and the core may queue the next step between
them (``ExecutionPlan.host_ahead``). The code sequences' hidden states leave as one
tensor (``RunnerOutput.hidden``), never one per sequence. Noise: ``engine.noise`` (which source is
reference-identical).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from ..models.chattts.checkpoint import LoadedModel
from ..models.chattts.config import GPTConfig
from ..models.chattts.gpt import KVCache
from ..models.chattts.prepare import ModelLayout
from .cuda_graph import GraphStore
from .decode_onnx import OnnxDecode
from .decode_path import DecodePath, DecodeStep, Heads, RunnerParts
from .decode_rows import RowsDecode
from .decode_static import StaticDecode
from .noise import seed_value
from .outputs import RunnerOutput, SchedulerOutput
from .plan import DECODE_PATHS as PATH_NAMES
from .plan import ExecutionPlan
from .prefill_runner import KindPrefill, Prefiller, SeqInputs, StepSampling
from .request import Sequence
from .slot_memory import slot_cost
from .slot_sampler import SlotSampler
from .slot_state import Admission, HostStaging, SlotState, TokenReadback
from .step_graph import StepGraph
from .step_plan import StepPlan, bind, build_plan

__all__ = ["DECODE_PATHS", "ModelRunner", "SeqInputs", "StepSampling", "auto_num_slots", "fitted_model_len"]

DECODE_PATHS: dict[str, Callable[[RunnerParts], DecodePath]] = {
    "rows": RowsDecode,
    "static": StaticDecode,
    "step-graph": StepGraph,
    "onnx": OnnxDecode,
}
"""``ExecutionPlan.decode`` -> its path (``engine.decode_path``): a new trunk backend adds its line here."""
assert tuple(DECODE_PATHS) == PATH_NAMES


@dataclass(frozen=True, slots=True)
class LaunchedStep:
    """A step queued on the device whose tokens the host has not read yet (``ModelRunner.launch``)."""

    plan: StepPlan
    copy: tuple[int, int] | None
    """The tokens' copy to the host (``TokenReadback.start``); None: the step sampled nothing."""
    hidden: torch.Tensor | None
    """The code rows' hidden states (a tensor of its own: no later step writes it)."""


def _one(parts: list[torch.Tensor]) -> torch.Tensor | None:
    return (torch.cat(parts) if len(parts) > 1 else parts[0]) if parts else None


class StageTimer(Protocol):
    """Times named stages of a step (``bench.profile``): ``with timer.stage("prefill"): ...``."""

    def stage(self, name: str) -> AbstractContextManager: ...


MAX_AUTO_SLOTS = 512
"""Most KV slots ``auto_num_slots`` gives (500 concurrent streams fit): beyond it the static step's
buckets (captured graphs: 10 batch x 5 context buckets at 512 slots and 2304 positions, two step
graphs each) and the per-step host work grow with no one to serve. Set ``max_num_seqs`` to go further."""

AUTO_SLOTS_FRACTION = {"cuda": 0.75, "cpu": 0.5}
"""Share of the free memory the KV cache may take: on CUDA all but the quarter
``distributed.memory.ACTIVATION_RESERVE`` keeps for activations, the audio decode and CUDA graphs;
on a CPU half (host RAM is shared with everything else)."""


def auto_num_slots(
    model: LoadedModel, max_len: int, device: torch.device, dtype: torch.dtype, fraction: float | None = None
) -> int:
    """KV slots of ``dtype`` (``ExecutionPlan.kv_cache_dtype``) that fit in ``fraction`` (default
    ``AUTO_SLOTS_FRACTION`` of the device type) of the free device memory (host RAM on CPU), 1 to
    ``MAX_AUTO_SLOTS``."""
    if fraction is None:
        fraction = AUTO_SLOTS_FRACTION.get(device.type, 0.5)
    cost = slot_bytes(model.config.gpt, max_len, dtype, graphs=device.type == "cuda")
    return slots_that_fit(free_bytes(device), fraction, cost)


MIN_FITTED_MODEL_LEN = 2048 + 256
"""``fitted_model_len`` lowers ``max_model_len`` no further: the old default, which fixed slots always got."""


def fitted_model_len(
    model: LoadedModel,
    num_slots: int,
    max_len: int,
    device: torch.device,
    dtype: torch.dtype,
    fraction: float | None = None,
) -> int:
    """``max_len``, or less where ``num_slots`` slots of it do not fit ``auto_num_slots``'s share of the
    free memory (never below ``MIN_FITTED_MODEL_LEN``): fixed slots keep their count, and a slot is as long
    as memory allows up to the checkpoint's positions."""
    if fraction is None:
        fraction = AUTO_SLOTS_FRACTION.get(device.type, 0.5)
    graphs = device.type == "cuda"
    # A slot's bytes are affine in its length (``slot_memory``): fixed + per_position * length.
    one, two = (slot_bytes(model.config.gpt, n, dtype, graphs) for n in (1, 2))
    per_position, fixed = two - one, 2 * one - two
    fit = int((free_bytes(device) * fraction / num_slots - fixed) // per_position)
    return max(min(max_len, MIN_FITTED_MODEL_LEN), min(max_len, fit))


def free_bytes(device: torch.device) -> int:
    """Free device memory (host RAM available on a CPU)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def slot_bytes(cfg: GPTConfig, max_len: int, kv_dtype: torch.dtype, graphs: bool = False) -> int:
    """Device bytes one sequence slot holds (``slot_memory.slot_cost``): its keys and values with the
    scratch position, its audio stream's hidden-state row and headroom, and (``graphs``: CUDA) its row
    of the step graphs' pool."""
    return slot_cost(cfg, max_len, kv_dtype, graphs).total


def slots_that_fit(free_bytes: int, fraction: float, bytes_per_slot: int) -> int:
    """``fraction`` of ``free_bytes`` in slots of ``bytes_per_slot``, 1 to ``MAX_AUTO_SLOTS``."""
    return max(1, min(MAX_AUTO_SLOTS, int(free_bytes * fraction // bytes_per_slot)))


class ModelRunner:
    def __init__(
        self,
        model: LoadedModel,
        layout: ModelLayout,
        num_slots: int,
        max_model_len: int,
        text_eos_id: int,
        plan: ExecutionPlan,
        max_prefill_tokens: int = 2048,
        prefill_chunk: int = 0,
    ) -> None:
        """``model`` as ``models.chattts.prepare.prepare_model`` left it (``layout``); the runner never changes it.
        ``plan``: what runs (``engine.plan.resolve_plan``). ``max_prefill_tokens``: prompt tokens per torch
        prefill call (``SchedulerConfig``'s budget per step; a longer prompt still goes alone, whole).
        ``prefill_chunk``: ``SchedulerConfig``'s (chunked prefill on: the torch prefill attention runs in query
        blocks of that many positions, which makes a chunked prompt's result its one-shot one; 0: one call)."""
        self.model = model
        self.plan = plan
        self.device = model.embed.emb_text.weight.device
        trunk = layout.trunk
        """``ort-*``: prefill and decode run in this ONNX Runtime session over the same slot cache."""
        if trunk is not None:
            cache = trunk.new_cache(num_slots, max_model_len)
        else:
            # The static step needs one scratch position past the last real one (see engine.cuda_graph).
            extra = 1 if plan.decode_mode == "static" else 0
            cache = model.gpt.new_cache(num_slots, max_model_len + extra, dtype=plan.kv_cache_dtype)
        self.cache: KVCache = cache
        self.num_vq = model.config.gpt.num_vq
        self.text_eos_id = text_eos_id
        self.states: dict[int, int] = {}
        """seq_id -> slot of every sequence with sampling state (registered at prefill)."""
        self._owner: list[int | None] = [None] * num_slots
        self.slot_state = SlotState(num_slots, self.num_vq, self.device)
        # Admissions (words each) and the step's index tensors (at most 3 per sequence) in one copy.
        self._staging = HostStaging(num_slots * (self.slot_state.words + 3) + 8, self.device)
        self._readback = TokenReadback(num_slots * self.num_vq, self.device)
        self._plan: StepPlan | None = None
        self.heads = Heads(model, layout.pad_rows_to)
        self.sampler = SlotSampler(self.slot_state, num_slots, plan.sampling_noise, text_eos_id, self.device)
        self.stage_timer: StageTimer | None = None
        """Set to time the prefill / decode / sampling stages of every step (profiling)."""
        self.graph_store = GraphStore(self.device)
        """Every CUDA graph of this engine, their pool and their one capture stream (``cuda_graph``)."""
        self.parts = RunnerParts(
            model, layout, plan, cache, self.slot_state, self.heads, self.sampler, self.graph_store
        )
        self.decode_path: DecodePath = DECODE_PATHS[plan.decode](self.parts)
        """The one decode path, chosen once (``engine.decode_path``)."""
        # One slot, unprepared fp32: every matmul runs on exactly the rows a batch-1 reference run uses
        # (bit-exact with chattts). More slots: packed weights or padded rows (see models.chattts.prepare).
        self.prefiller = Prefiller(
            model, cache, trunk, layout.pad_rows_to, max_prefill_tokens, self.decode_path.prefill, prefill_chunk
        )

    def use_decode_path(self, make: Callable[[RunnerParts], DecodePath]) -> DecodePath:
        """Run every later step's decode rows through ``make(parts)`` instead (``bench.host_overhead``
        stands in for the device's work this way); returns it."""
        self.decode_path = make(self.parts)
        self.prefiller.trunk_rows = self.decode_path.prefill
        return self.decode_path

    @property
    def sync_free(self) -> bool:
        """Sampling takes no branch that reads a device value back (``SlotSampler.sync_free``)."""
        return self.sampler.sync_free

    @sync_free.setter
    def sync_free(self, value: bool) -> None:
        self.sampler.sync_free = value

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        """The dtype the KV cache holds keys and values in (``eval`` replays the trunk in it)."""
        return self.cache.k.dtype

    @property
    def kv_bytes_per_position(self) -> int:
        """Bytes of keys and values one cached position of one slot holds, all layers together: what a
        decode step reads per position it attends to (``profile``'s memory floor)."""
        k = self.cache.k  # [layers, slots, kv_heads, positions, head_dim]
        return 2 * k.shape[0] * k.shape[2] * KVCache.vector_bytes(k.shape[4], k.dtype)  # int8: with its scales

    def counters(self) -> dict[str, int]:
        """The decode path's graph counters, every ``EngineStats`` one present (0 where the path has none)."""
        out = dict.fromkeys(_COUNTERS, 0)
        out.update(self.decode_path.counters())
        return out

    # ------------------------------------------------------------------ one step

    def release(self, finished: list[Sequence]) -> None:
        """Drop the sampling state of sequences that left the running set."""
        for seq in finished:
            slot = self.states.pop(seq.seq_id, None)
            if slot is not None and self._owner[slot] == seq.seq_id:
                self._owner[slot] = None
                self.sampler.release(slot)

    def audio_beside(self, sched: SchedulerOutput) -> bool:
        """Whether audio may be decoded beside a step like ``sched`` on a CPU's audio worker (the decode path's
        call, at the step's width: its decode rows and prompt tokens)."""
        return self.decode_path.audio_beside(len(sched.decode) + sum(c.length for c in sched.chunks()))

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """Run the step and read its tokens (``launch``, then ``collect``)."""
        return self.collect(self.launch(sched))

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput) -> LaunchedStep:
        """Queue the step on the device (the decode path's ``decode``), its tokens' copy to the host
        included, without waiting for anything: the host may schedule and queue the next step before
        ``collect`` reads this one."""
        first: dict[str, torch.Tensor] = {}
        code_hidden: list[torch.Tensor] = []  # in the code kind's sampling order: prefills, then decodes
        admissions: list[Admission] = []
        chunks = sched.chunks()
        if chunks:
            with self._stage("prefill"):
                pre: dict[str, KindPrefill] = self.prefiller.run(chunks)
                first = {kind: p.logits for kind, p in pre.items()}
                if "code" in pre:
                    code_hidden.append(pre["code"].last)
                admissions = [self._admission(seq) for seq in sched.prefill]
        plan = self._step_plan(sched, admissions)
        if not plan.kinds:  # prompt chunks only: nothing samples
            return LaunchedStep(plan, None, None)
        out = self.decode_path.decode(DecodeStep(plan, sched.decode, first, self._stage))
        if out.hidden is not None:
            code_hidden.append(out.hidden)
        tokens = out.tokens
        copy = self._readback.start(torch.cat(tokens) if len(tokens) > 1 else tokens[0])
        # ^ the step's one device-to-host copy (its one wait is ``collect``'s)
        return LaunchedStep(plan, copy, _one(code_hidden))

    def collect(self, step: LaunchedStep) -> RunnerOutput:
        """Wait for a launched step's tokens (the step's one wait) and hand them out per sequence."""
        if step.copy is None:
            return RunnerOutput({})
        return self._output(step.plan, self._readback.finish(step.copy), step.hidden)

    def _output(self, plan: StepPlan, flat: np.ndarray, hidden: torch.Tensor | None) -> RunnerOutput:
        """The step's tokens per sequence from the host copy ``flat`` (kinds in plan order), and the code
        sequences' hidden states (one tensor)."""
        tokens: dict[int, tuple[int, ...]] = {}
        hidden_rows: dict[int, int] = {}
        pos = 0
        for k in plan.kinds:
            n = len(k.seqs) * k.rows
            tokens.update(zip(k.ids, map(tuple, flat[pos : pos + n].reshape(-1, k.rows).tolist()), strict=True))
            pos += n
            if k.kind == "code":
                hidden_rows = {seq_id: row for row, seq_id in enumerate(k.ids)}
        return RunnerOutput(tokens, hidden, hidden_rows)

    # ------------------------------------------------------------------ pieces

    def _stage(self, name: str) -> AbstractContextManager:
        return self.stage_timer.stage(name) if self.stage_timer is not None else nullcontext()

    def _admission(self, seq: Sequence) -> Admission:
        """The sequence's sampling row; the generator source also gets its generator now."""
        s: StepSampling = seq.payload.sampling
        rows = self.num_vq if seq.kind == "code" else 1
        temps = s.temperature if len(s.temperature) == self.num_vq else s.temperature * self.num_vq
        if len(temps) != self.num_vq or len(s.temperature) not in (1, rows):
            raise ValueError(f"{seq.kind} sequence: expected 1 or {rows} temperatures, got {len(s.temperature)}")
        # Unseeded: from the global RNG, so torch.manual_seed() still makes unseeded runs repeatable.
        seed = s.seed if s.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
        self.sampler.admit(seq.slot, seed, s.seed is not None, rows, self.heads.vocab[seq.kind])
        self.states[seq.seq_id] = seq.slot
        self._owner[seq.slot] = seq.seq_id
        return Admission(
            seq.slot,
            seq.prompt_len,
            seq.min_new_tokens,
            s.top_k,
            seed_value(seed),
            s.top_p,
            s.repetition_penalty,
            temps,
        )

    def _step_plan(self, sched: SchedulerOutput, admissions: list[Admission]) -> StepPlan:
        """This step's index tensors: the last step's when the running set is unchanged, else staged
        together with the admissions and sent in the step's one host-to-device copy."""
        if self._plan is not None and self._plan.reusable_for(sched):
            return self._plan
        st = self._staging
        off = self.slot_state.stage(st, admissions) if admissions else 0
        plan = build_plan(sched, st, self.num_vq, self.heads.vocab)
        st.flush()
        bind(plan, st)
        if admissions:
            self.slot_state.admit(st, off, len(admissions))
        self._plan = plan
        return plan


_COUNTERS = (
    "graph_replays",
    "eager_steps",
    "graphs_refused",
    "step_graph_replays",
    "step_graph_eager_steps",
    "step_graphs_captured",
    "step_graphs_refused",
)
"""The graph counters of ``engine.core.EngineStats``."""
