"""The model runner: turns a ``SchedulerOutput`` into device work and a ``RunnerOutput``.

Prefill: each newly admitted sequence's prompt goes into its own slot, all of a step's prompts in as
few trunk calls as the mode allows, and their first logits from one heads call per kind where rows
are independent (``engine.prefill_runner``).

Decode: all running sequences, text and code mixed, in one trunk call; heads and sampling per kind,
batched. Sampling state lives on the device per KV slot (``engine.slot_state``): admission writes it,
a step gathers it by slot index and writes its tokens back, so host work and launches do not grow
with the batch (except the ``generator`` noise source's one draw per unseeded sequence, and the CPU
row-by-row attention). A step moves data between host and device at most twice: one staging copy in
(admissions and index tensors, none while the running set is unchanged) and one copy out (the sampled
tokens), which is the step's only wait on the device. The code sequences' hidden states leave as one
tensor (``RunnerOutput.hidden``), never one per sequence. Noise: ``engine.noise`` (which source is
reference-identical).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from ..kernels import decode_attention
from ..models.chattts.checkpoint import LoadedModel
from ..models.chattts.config import AUDIO_EOS, GPTConfig
from ..models.chattts.gpt import KVCache
from ..models.chattts.prepare import ModelLayout
from .config import RunnerConfig
from .cuda_graph import GraphStore, StaticDecoder
from .noise import CounterNoise, GeneratorNoise, resolve_noise, seed_value
from .outputs import RunnerOutput, SchedulerOutput
from .prefill_runner import KindPrefill, Prefiller, SeqInputs, StepSampling
from .request import Sequence
from .sampler import PENALTY_WINDOW, batched_probs, sample_with_noise
from .slot_memory import slot_cost
from .slot_state import Admission, HostStaging, SlotState, TokenReadback
from .step_graph import StepGraph, step_graphs_apply
from .step_plan import KindRows, StepPlan, bind, build_plan

__all__ = ["ModelRunner", "SeqInputs", "StepSampling", "auto_num_slots", "fitted_model_len"]


@dataclass(frozen=True, slots=True)
class LaunchedStep:
    """A step queued on the device whose tokens the host has not read yet (``ModelRunner.launch``)."""

    plan: StepPlan
    copy: tuple[int, int]
    """The tokens' copy to the host (``TokenReadback.start``)."""
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
    """KV slots of ``dtype`` (``KVCache.dtype_for``) that fit in ``fraction`` (default
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
        config: RunnerConfig | None = None,
        max_prefill_tokens: int = 2048,
    ) -> None:
        """``model`` as ``models.chattts.prepare.prepare_model`` left it (``layout``); the runner never changes it.
        ``max_prefill_tokens``: prompt tokens per torch prefill call (``SchedulerConfig``'s budget per
        step; a longer prompt still goes alone, whole)."""
        self.model = model
        self.config = config or RunnerConfig()
        self.device = model.embed.emb_text.weight.device
        self.dtype = model.gpt.norm.weight.dtype
        self.trunk = layout.trunk
        """``ort-*``: prefill and decode run in this ONNX Runtime session over the same slot cache."""
        self.decode_mode = "onnx" if self.trunk is not None else self.config.resolve(self.device.type)
        # The static step needs one scratch position past the last real one (see engine.cuda_graph).
        extra = 1 if self.decode_mode == "static" else 0
        if self.trunk is not None:
            if self.config.kv_cache_dtype == "bf16":
                raise ValueError("kv_cache_dtype bf16 is for the torch precisions; the ort-* cache is fp32")
            self.cache = self.trunk.new_cache(num_slots, max_model_len)
        else:
            kv_dtype = KVCache.dtype_for(self.config.kv_cache_dtype, layout.precision.trunk_dtype)
            self.cache = model.gpt.new_cache(num_slots, max_model_len + extra, dtype=kv_dtype)
            if self.decode_mode == "rows":  # build the bf16 cache's attention kernel now, not mid-request
                decode_attention.prepare(self.cache.k)
        if self.decode_mode == "static":
            self.cache.k.zero_(), self.cache.v.zero_()  # rows that decode nothing read finite values
        self.num_vq = model.config.gpt.num_vq
        self.text_eos_id = text_eos_id
        # One slot, unprepared fp32: every matmul runs on exactly the rows a batch-1 reference run uses
        # (bit-exact with chattts). More slots: packed weights or padded rows (see models.chattts.prepare).
        self.pad_rows_to = layout.pad_rows_to
        self.packed = layout.packed
        self.prefiller = Prefiller(model, self.cache, self.trunk, self.pad_rows_to, max_prefill_tokens)
        self.states: dict[int, int] = {}
        """seq_id -> slot of every sequence with sampling state (registered at prefill)."""
        self._owner: list[int | None] = [None] * num_slots
        self.slot_state = SlotState(num_slots, self.num_vq, self.device)
        # Admissions (words each) and the step's index tensors (at most 3 per sequence) in one copy.
        self._staging = HostStaging(num_slots * (self.slot_state.words + 3) + 8, self.device)
        self._readback = TokenReadback(num_slots * self.num_vq, self.device)
        self._plan: StepPlan | None = None
        self._vocab = {"code": model.embed.head_code.shape[1], "text": model.embed.head_text.shape[0]}
        self.noise_source = resolve_noise(self.config.sampling_noise, self.device.type)
        self._generator_noise = GeneratorNoise(num_slots, self.device) if self.noise_source == "generator" else None
        self._counter_noise = CounterNoise(self.device)
        self.sync_free = self.device.type != "cpu"
        """Sampling takes no branch that reads a device value back. On the CPU (False) two such
        shortcuts are free and faster (``sampler.batched_probs``); tests set True there to run the
        device path."""
        self.stage_timer: StageTimer | None = None
        """Set to time the prefill / decode / sampling stages of every step (profiling)."""
        cfg = self.config
        step_graphs = step_graphs_apply(
            cfg.step_graphs, self.device.type, self.decode_mode, self.noise_source, cfg.cuda_graphs
        )
        self.graph_store = GraphStore(self.device)
        """Every CUDA graph of this engine, their pool and their one capture stream (``cuda_graph``)."""
        self.static: StaticDecoder | None = None
        if self.decode_mode == "static":
            # With step graphs every decode step replays one of them: the trunk's own graphs (one per
            # bucket, captured at start-up) would never replay, so they are not captured.
            trunk_graphs = cfg.cuda_graphs and not step_graphs
            self.static = StaticDecoder(
                model.gpt, self.cache, trunk_graphs, cfg.compile, cfg.strict_cuda_graphs, self.graph_store
            )
        self.step_graph: StepGraph | None = None
        """Decode rows as one graph (the CUDA defaults; ``engine.step_graph``)."""
        if step_graphs:
            self.step_graph = StepGraph(self, cfg.cuda_graphs, cfg.strict_cuda_graphs)

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        """The dtype the KV cache holds keys and values in (``eval`` replays the trunk in it)."""
        return self.cache.k.dtype

    @property
    def kv_bytes_per_position(self) -> int:
        """Bytes of keys and values one cached position of one slot holds, all layers together: what a
        decode step reads per position it attends to (``profile``'s memory floor)."""
        k = self.cache.k  # [layers, slots, kv_heads, positions, head_dim]
        return 2 * k.shape[0] * k.shape[2] * k.shape[4] * k.element_size()

    # ------------------------------------------------------------------ one step

    def release(self, finished: list[Sequence]) -> None:
        """Drop the sampling state of sequences that left the running set."""
        for seq in finished:
            slot = self.states.pop(seq.seq_id, None)
            if slot is not None and self._owner[slot] == seq.seq_id:
                self._owner[slot] = None
                if self._generator_noise is not None:
                    self._generator_noise.release(slot)

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """Run the step and read its tokens (``launch``, then ``collect``)."""
        return self.collect(self.launch(sched))

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput) -> LaunchedStep:
        """Queue the step on the device, its tokens' copy to the host included, without waiting for
        anything: the host may schedule and queue the next step before ``collect`` reads this one."""
        logits: dict[str, list[torch.Tensor]] = {"code": [], "text": []}
        code_hidden: list[torch.Tensor] = []  # in the code kind's sampling order: prefills, then decodes
        admissions: list[Admission] = []
        if sched.prefill:
            with self._stage("prefill"):
                pre: dict[str, KindPrefill] = self.prefiller.run(sched.prefill)
                for kind, p in pre.items():
                    logits[kind].append(p.logits)
                if "code" in pre:
                    code_hidden.append(pre["code"].last)
                admissions = [self._admission(seq) for seq in sched.prefill]
        plan = self._step_plan(sched, admissions)
        if sched.decode and self.step_graph is not None:
            return self._execute_graph(sched, plan, logits, code_hidden)
        if sched.decode:
            with self._stage("decode"):
                h_dec = self._decode_trunk(sched.decode, plan)  # [rows, hidden], padded
                for k in plan.kinds:
                    if k.n_decode:
                        logits[k.kind].append(self._heads(k.kind, h_dec, k.dec_pos, k.n_decode))
                        if k.kind == "code":
                            code_hidden.append(h_dec.index_select(0, k.dec_pos))
        with self._stage("sampling"):
            sampled = [self._sample(k, torch.cat(logits[k.kind])) for k in plan.kinds]
            copy = self._readback.start(torch.cat(sampled) if len(sampled) > 1 else sampled[0])
            # ^ the step's one device-to-host copy (its one wait is ``collect``'s)
        return LaunchedStep(plan, copy, _one(code_hidden))

    def collect(self, step: LaunchedStep) -> RunnerOutput:
        """Wait for a launched step's tokens (the step's one wait) and hand them out per sequence."""
        return self._output(step.plan, self._readback.finish(step.copy), step.hidden)

    def _execute_graph(
        self,
        sched: SchedulerOutput,
        plan: StepPlan,
        prefill_logits: dict[str, list[torch.Tensor]],
        code_hidden: list[torch.Tensor],
    ) -> LaunchedStep:
        """The step with its decode rows in one graph (``engine.step_graph``): the admissions' first
        tokens are sampled eagerly first (they are not in the graph's rows), then the graph runs every
        decode row; the tokens come back in one copy, in the order ``_output`` reads."""
        assert self.step_graph is not None
        first: dict[str, torch.Tensor] = {}
        if sched.prefill:
            with self._stage("sampling"):
                for k in plan.kinds:
                    if k.n_prefill:
                        assert k.slots is not None
                        slots, hosts = k.slots[: k.n_prefill], k.host_slots[: k.n_prefill]
                        first[k.kind] = self.sample_slots(
                            k.kind, slots, k.n_prefill, k.rows, k.k_max, prefill_logits[k.kind][0], hosts
                        )
        with self._stage("decode"):
            decoded, h = self.step_graph.run(plan, max(s.cache_len for s in sched.decode))
        parts = []
        for k in plan.kinds:  # each kind: its admissions, then its decode rows (plan order)
            parts += [t[k.kind] for t in (first, decoded) if k.kind in t]
        copy = self._readback.start(torch.cat(parts) if len(parts) > 1 else parts[0])
        # The graph's hidden states are its static output, rewritten by the next replay, which the host
        # may queue before this step's hidden states are written to the streams: a copy of its own.
        if h is not None:  # with admissions ``_one`` concatenates (a copy); alone, a copy of its own
            code_hidden = [*code_hidden, h] if code_hidden else [h.clone()]
        return LaunchedStep(plan, copy, _one(code_hidden))

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
        if self._generator_noise is not None:
            self._generator_noise.admit(seq.slot, seed, s.seed is not None, rows, self._vocab[seq.kind])
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
        plan = build_plan(sched, st, self.num_vq, self._vocab)
        st.flush()
        bind(plan, st)
        if admissions:
            self.slot_state.admit(st, off, len(admissions))
        self._plan = plan
        return plan

    def _decode_trunk(self, seqs: list[Sequence], plan: StepPlan) -> torch.Tensor:
        """Embed every decoding slot's last token (kept on the device) and run the trunk step."""
        embed = self.model.embed
        assert plan.dec_slots is not None
        parts = []
        for k in plan.kinds:
            if k.n_decode:
                last = self.slot_state.last.index_select(0, k.dec_slots)  # text ids fill every column
                parts.append((k, embed.embed_codes(last) if k.kind == "code" else embed.embed_text(last[:, 0])))
        if len(parts) == 1:
            emb = parts[0][1]  # one kind: its rows are the decode rows, in order
        else:
            emb = torch.empty(len(seqs), embed.emb_text.weight.shape[1], device=self.device)
            for k, rows in parts:
                emb.index_copy_(0, k.dec_pos, rows)
        if self.static is not None:
            max_len = max(s.cache_len for s in seqs)
            positions = self.slot_state.positions(plan.dec_slots)
            return self.static.run(emb, plan.dec_slots, positions, plan.max_slot, max_len).float()
        # The row-by-row modes slice the cache with host ints (CPU paths: no device to wait for).
        lengths = [s.cache_len for s in seqs]
        slots = [s.slot for s in seqs]
        if self.trunk is not None:
            return self._decode_onnx(emb, slots, lengths)
        return self.model.gpt.decode(emb.to(self.dtype), self.cache, slots, lengths, self.pad_rows_to).float()

    def _decode_onnx(self, emb: torch.Tensor, slots: list[int], lengths: list[int]) -> torch.Tensor:
        """One ORT step over the slot block ``min(slots) .. max(slots)`` (one contiguous piece of each
        layer's cache, bound without a copy). Slots in between that decode nothing this step (free,
        or prefilled this step) are idle rows: zero input, and their cache is left as it is."""
        lo = min(slots)
        rows = [s - lo for s in slots]
        block = max(slots) - lo + 1
        x = emb.new_zeros(block, 1, emb.shape[1])
        x[rows, 0] = emb
        seqlens_k = np.zeros(block, dtype=np.int32)
        seqlens_k[rows] = lengths  # the new token goes to position lengths[b]: lengths[b] + 1 cached after
        active = np.zeros(block, dtype=np.int32)
        active[rows] = 1
        return self.trunk.run(x, self.cache, lo, seqlens_k, active)[rows, 0]

    def _heads(self, kind: str, h: torch.Tensor, idx: torch.Tensor, n: int) -> torch.Tensor:
        """Logits of decode rows ``idx`` (``n`` of them), the matmul padded to ``pad_rows_to`` rows."""
        rows = h.index_select(0, idx)
        m = -(-n // self.pad_rows_to) * self.pad_rows_to
        if m != n:
            rows = torch.cat([rows, rows.new_zeros(m - n, rows.shape[1])])
        if kind == "code":
            return self.model.embed.code_logits(rows)[: n * self.num_vq]
        return self.model.embed.text_logits(rows)[:n]

    def _sample(self, k: KindRows, logits: torch.Tensor) -> torch.Tensor:
        """One kind's tokens ``[len(seqs) * rows]``, every row with its slot's parameters, gathered on
        the device in a fixed number of launches; then recorded into the slots' state."""
        assert k.slots is not None
        return self.sample_slots(k.kind, k.slots, len(k.seqs), k.rows, k.k_max, logits, k.host_slots)

    def sample_slots(
        self,
        kind: str,
        slots: torch.Tensor,
        n: int,
        rows: int,
        k_max: int,
        logits: torch.Tensor,
        host_slots: list[int] | None = None,
        active: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Tokens ``[n * rows]`` of the ``n`` sequences in ``slots`` from their ``logits`` ``[n * rows, V]``,
        recorded into the slots' state. ``k_max`` >= every row's effective top_k (the vocabulary always
        is: the same k-th value, no host value in the shapes). ``host_slots``: the generator noise's
        slots. ``active`` ``[n]`` bool (the whole-step graph, ``engine.step_graph``): rows that are not
        active are sampled but leave their slot's state as it was."""
        st = self.slot_state

        def per_row(values: torch.Tensor) -> torch.Tensor:  # [n] per sequence -> [n * rows]
            return values[:, None].expand(n, rows).reshape(n * rows)

        generated = st.generated.index_select(0, slots)
        temperature = st.temperature.index_select(0, slots)[:, :rows].reshape(n * rows, 1)
        penalty = per_row(st.penalty.index_select(0, slots))[:, None]
        top_p = per_row(st.top_p.index_select(0, slots))[:, None]
        top_k = per_row(st.top_k.index_select(0, slots))
        block = per_row(generated < st.min_new_tokens.index_select(0, slots))
        history = st.history.index_select(0, slots)[:, :rows].reshape(n * rows, PENALTY_WINDOW)
        valid = st.window[None] < per_row(generated.clamp(max=PENALTY_WINDOW))[:, None]
        if active is not None:  # a row that is not active may hold a text id or a freed slot's ids
            history = history.masked_fill(~per_row(active)[:, None], 0)
        eos = AUDIO_EOS if kind == "code" else self.text_eos_id
        probs = batched_probs(
            logits,
            history,
            valid,
            temperature,
            penalty,
            top_p,
            top_k,
            k_max,
            block,
            eos,
            host_reads=not self.sync_free,
        )
        vocab = logits.shape[-1]
        if self._generator_noise is not None:
            assert host_slots is not None
            noise = self._generator_noise(host_slots, rows, vocab)
        else:
            noise = self._counter_noise(st.seed.index_select(0, slots), generated, rows, vocab)
        tokens = sample_with_noise(probs, noise)
        if active is None:
            st.record(slots, generated, tokens.view(n, rows))
        else:
            st.record_active(n, generated, tokens.view(n, rows), active)
        return tokens
