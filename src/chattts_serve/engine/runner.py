"""The model runner: turns a ``SchedulerOutput`` into device work and a ``RunnerOutput``.

Prefill: each newly admitted sequence's prompt goes into its own slot. Torch modes: one sequence per
call, so a sequence's prompt is computed the same way whatever else is admitted, and without padding.
``ort-*`` modes: the prompts of sequences in consecutive slots go in one ONNX Runtime call, right-padded
to the longest (``query_seqlens`` tells the op each row's length; a burst of 32 admissions is one call, not
32, each of which would stream all the weights once). Decode:
all running sequences, text and code mixed, in one trunk call; heads and sampling per kind, batched,
with every sequence's own parameters and generator. One device-to-host copy per step (the tokens).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from ..model import decode_attention
from ..model.checkpoint import LoadedModel
from ..model.config import AUDIO_EOS
from ..model.gpt import KVCache
from ..model.prepare import ModelLayout
from .config import RunnerConfig
from .cuda_graph import StaticDecoder
from .outputs import RunnerOutput, SchedulerOutput
from .request import Sequence
from .sampler import PENALTY_WINDOW, batched_probs, effective_top_k, sample_with_noise


@dataclass(frozen=True, slots=True)
class StepSampling:
    """How one sequence samples (its length limits are the ``Sequence``'s own)."""

    temperature: tuple[float, ...]  # 1 value (text) or one per codebook (code)
    top_p: float
    top_k: int
    repetition_penalty: float
    seed: int | None
    """Re-seed the sequence's generator with this before every step (None: random)."""


@dataclass(slots=True)
class SeqInputs:
    """``Sequence.payload``: what the runner needs to prefill a sequence."""

    ids: list[int]  # prompt token ids
    sampling: StepSampling
    speaker: torch.Tensor | None = None  # [hidden] normalized; replaces the [spk_emb] position
    speaker_token_id: int | None = None
    prompt_codes: torch.Tensor | None = None  # [T_s, 4] voice-sample codes after the text


class StageTimer(Protocol):
    """Times named stages of a step (``bench.profile``): ``with timer.stage("prefill"): ...``."""

    def stage(self, name: str) -> AbstractContextManager: ...


def auto_num_slots(
    model: LoadedModel, max_len: int, device: torch.device, dtype: torch.dtype, fraction: float = 0.5
) -> int:
    """KV slots of ``dtype`` (``KVCache.dtype_for``) that fit in ``fraction`` of the free device
    memory (host RAM on CPU), 1..256."""
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        import os

        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    per_slot = KVCache.bytes_per_slot(model.config.gpt, max_len, dtype)
    return max(1, min(256, int(free * fraction // per_slot)))


class _SeqState:
    """Runner-side state of a running sequence: sampling rows, history, generator."""

    def __init__(self, seq: Sequence, rows: int, device: torch.device, vocab: int) -> None:
        s: StepSampling = seq.payload.sampling
        self.seq, self.rows, self.s = seq, rows, s
        temps = s.temperature if len(s.temperature) == rows else s.temperature * rows
        self.temperature = torch.tensor(temps, dtype=torch.float32, device=device).view(rows, 1)
        self.history = torch.zeros(rows, PENALTY_WINDOW, dtype=torch.long, device=device)
        self.generator = torch.Generator(device=device)
        if s.seed is None:
            # From the global RNG, so torch.manual_seed() still makes unseeded runs repeatable.
            self.generator.manual_seed(int(torch.randint(0, 2**62, (1,)).item()))
        self._noise: torch.Tensor | None = None
        self._shape = (rows, vocab)
        self._device = device

    def noise(self) -> torch.Tensor:
        if self.s.seed is not None:
            # The reference re-seeds before every step, so a seeded sequence reuses one noise draw.
            if self._noise is None:
                self.generator.manual_seed(self.s.seed)
                self._noise = torch.empty(self._shape, device=self._device).exponential_(1, generator=self.generator)
            return self._noise
        return torch.empty(self._shape, device=self._device).exponential_(1, generator=self.generator)

    def record(self, token: torch.Tensor, step: int) -> None:
        self.history[:, step % PENALTY_WINDOW] = token


class ModelRunner:
    def __init__(
        self,
        model: LoadedModel,
        layout: ModelLayout,
        num_slots: int,
        max_model_len: int,
        text_eos_id: int,
        config: RunnerConfig | None = None,
    ) -> None:
        """``model`` as ``model.prepare.prepare_model`` left it (``layout``); the runner never changes it."""
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
        # (bit-exact with chattts). More slots: packed weights or padded rows (see model.prepare).
        self.pad_rows_to = layout.pad_rows_to
        self.packed = layout.packed
        self.states: dict[int, _SeqState] = {}
        self.stage_timer: StageTimer | None = None
        """Set to time the prefill / decode / sampling stages of every step (profiling)."""
        self._pin = self.device.type == "cuda"
        self.static: StaticDecoder | None = None
        if self.decode_mode == "static":
            cfg = self.config
            self.static = StaticDecoder(model.gpt, self.cache, cfg.cuda_graphs, cfg.compile, cfg.strict_cuda_graphs)

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

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """Host -> device; on CUDA through pinned memory without blocking the host."""
        if self._pin:
            return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)

    # ------------------------------------------------------------------ one step

    def release(self, finished: list[Sequence]) -> None:
        """Drop the sampling state of sequences that left the running set."""
        for seq in finished:
            self.states.pop(seq.seq_id, None)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        order: dict[str, list[Sequence]] = {"code": [], "text": []}
        logits: dict[str, list[torch.Tensor]] = {"code": [], "text": []}
        hidden: dict[int, torch.Tensor] = {}
        if sched.prefill:
            with self._stage("prefill"):
                if self.trunk is not None:
                    trunk_out = self._prefill_onnx(sched.prefill)
                else:
                    trunk_out = {seq.seq_id: self._prefill_trunk(seq) for seq in sched.prefill}
                for seq in sched.prefill:
                    h, lg = self._prefill(seq, trunk_out[seq.seq_id])
                    order[seq.kind].append(seq)
                    logits[seq.kind].append(lg)
                    hidden[seq.seq_id] = h
        if sched.decode:
            with self._stage("decode"):
                h_dec = self._decode_trunk(sched.decode)  # [rows, hidden], padded
                for kind in ("code", "text"):
                    idx = [i for i, s in enumerate(sched.decode) if s.kind == kind]
                    if idx:
                        logits[kind].append(self._heads(kind, h_dec, idx))
                        order[kind] += [sched.decode[i] for i in idx]
                        hidden.update((sched.decode[i].seq_id, h_dec[i]) for i in idx)
        kinds = [k for k in ("code", "text") if order[k]]
        with self._stage("sampling"):
            sampled = [self._sample(order[k], torch.cat(logits[k])) for k in kinds]
            flat = (torch.cat(sampled) if len(sampled) > 1 else sampled[0]).tolist() if sampled else []
            # ^ the step's one device-to-host copy
        tokens: dict[int, tuple[int, ...]] = {}
        pos = 0
        for kind in kinds:
            per = self.num_vq if kind == "code" else 1
            for s in order[kind]:
                tokens[s.seq_id] = tuple(flat[pos : pos + per])
                pos += per
        return RunnerOutput(tokens, {i: h for i, h in hidden.items() if i in {s.seq_id for s in order["code"]}})

    # ------------------------------------------------------------------ pieces

    def _stage(self, name: str) -> AbstractContextManager:
        return self.stage_timer.stage(name) if self.stage_timer is not None else nullcontext()

    def _prefill(self, seq: Sequence, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Finish one sequence's prefill from its trunk output ``h`` ``[prompt_len, hidden]``: returns its
        last hidden state and first logits, and sets up its sampling."""
        embed = self.model.embed
        logits = embed.code_logits(h)[-self.num_vq :] if seq.kind == "code" else embed.text_logits(h)[-1:]
        vocab = logits.shape[-1]
        self.states[seq.seq_id] = _SeqState(seq, self.num_vq if seq.kind == "code" else 1, self.device, vocab)
        return h[-1], logits

    def _prefill_onnx(self, seqs: list[Sequence]) -> dict[int, torch.Tensor]:
        """Trunk outputs ``[prompt_len, hidden]`` of every sequence in ``seqs``: one ORT call per run of
        consecutive slots, rows right-padded to the run's longest prompt (padding is zeros: it never
        enters a row's keys, and int8's per-call activation scale does not see it)."""
        out: dict[int, torch.Tensor] = {}
        by_slot = sorted(seqs, key=lambda s: s.slot)
        runs: list[list[Sequence]] = []
        for seq in by_slot:
            if runs and seq.slot == runs[-1][-1].slot + 1:
                runs[-1].append(seq)
            else:
                runs.append([seq])
        for run in runs:
            lens = np.array([s.prompt_len for s in run], dtype=np.int32)
            x = torch.zeros(len(run), int(lens.max()), self.model.embed.emb_text.weight.shape[1], device=self.device)
            for b, seq in enumerate(run):
                x[b, : seq.prompt_len] = self._embed_prompt(seq)[0]
            h = self.trunk.run(x, self.cache, run[0].slot, lens - 1, lens)
            out.update((seq.seq_id, h[b, : seq.prompt_len]) for b, seq in enumerate(run))
        return out

    def _prefill_trunk(self, seq: Sequence) -> torch.Tensor:
        emb = self._embed_prompt(seq)
        positions = torch.arange(seq.prompt_len, device=self.device)[None]
        slot = torch.tensor([seq.slot], device=self.device)
        # All positions through the final norm and heads, then the last row: the reference's order.
        return self.model.gpt(emb.to(self.dtype), positions, self.cache, slot, 0, None, last_only=False).float()[0]

    def _embed_prompt(self, seq: Sequence) -> torch.Tensor:
        """The prompt's input embeddings ``[1, prompt_len, hidden]`` (text, speaker, voice-sample codes)."""
        inp: SeqInputs = seq.payload
        embed = self.model.embed
        n_text = len(inp.ids)
        ids = torch.zeros(1, seq.prompt_len, self.num_vq, dtype=torch.long)
        ids[0, :n_text] = torch.tensor(inp.ids, dtype=torch.long)[:, None]
        if inp.prompt_codes is not None:
            ids[0, n_text:] = inp.prompt_codes.to(torch.long)
        text_mask = torch.zeros(1, seq.prompt_len, dtype=torch.bool)
        text_mask[0, :n_text] = True
        ids, text_mask = self._to_device(ids), self._to_device(text_mask)
        emb = embed.embed_prompt(ids, text_mask)
        if inp.speaker is not None:
            emb[0, ids[0, :, 0].eq(inp.speaker_token_id) & text_mask[0]] = inp.speaker.to(emb.dtype)
        return emb

    def _decode_trunk(self, seqs: list[Sequence]) -> torch.Tensor:
        embed = self.model.embed
        # Text tokens are (id,); widen them to 4 columns like the reference's input ids.
        last = self._to_device(torch.tensor([s.tokens[-1] * (self.num_vq // len(s.tokens[-1])) for s in seqs]))
        code_rows = [i for i, s in enumerate(seqs) if s.kind == "code"]
        text_rows = [i for i, s in enumerate(seqs) if s.kind == "text"]
        emb = torch.empty(len(seqs), embed.emb_text.weight.shape[1], device=self.device)
        if code_rows:
            emb[code_rows] = embed.embed_codes(last[code_rows])
        if text_rows:
            emb[text_rows] = embed.embed_text(last[text_rows, 0])
        lengths = [s.cache_len for s in seqs]
        slots = [s.slot for s in seqs]
        if self.trunk is not None:
            return self._decode_onnx(emb, slots, lengths)
        if self.static is not None:
            return self.static(emb, slots, lengths).float()
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

    def _heads(self, kind: str, h: torch.Tensor, idx: list[int]) -> torch.Tensor:
        rows = h[idx]
        n = len(idx)
        m = -(-n // self.pad_rows_to) * self.pad_rows_to
        if m != n:
            rows = torch.cat([rows, rows.new_zeros(m - n, rows.shape[1])])
        if kind == "code":
            return self.model.embed.code_logits(rows)[: n * self.num_vq]
        return self.model.embed.text_logits(rows)[:n]

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        states = [self.states[s.seq_id] for s in seqs]
        dev = self.device
        temperature = torch.cat([st.temperature for st in states])
        reps = [st.rows for st in states]

        def per_row(values, dtype):
            return torch.tensor(values, dtype=dtype, device=dev).repeat_interleave(torch.tensor(reps, device=dev))

        penalty = per_row([st.s.repetition_penalty for st in states], torch.float32)[:, None]
        top_p = per_row([st.s.top_p for st in states], torch.float64)[:, None]
        top_k = per_row([st.s.top_k for st in states], torch.long)
        k_max = max(effective_top_k(st.s.top_k, logits.shape[-1]) for st in states)
        steps = [s.num_generated for s in seqs]
        blocked = [n < s.min_new_tokens for n, s in zip(steps, seqs, strict=True)]
        block = per_row(blocked, torch.bool) if any(blocked) else None
        history = torch.cat([st.history for st in states])
        valid_len = per_row([min(n, PENALTY_WINDOW) for n in steps], torch.long)
        history_valid = torch.arange(PENALTY_WINDOW, device=dev)[None] < valid_len[:, None]
        eos = AUDIO_EOS if seqs[0].kind == "code" else self.text_eos_id
        probs = batched_probs(logits, history, history_valid, temperature, penalty, top_p, top_k, k_max, block, eos)
        noise = torch.cat([st.noise() for st in states])
        tokens = sample_with_noise(probs, noise)
        offset = 0
        for st, n in zip(states, steps, strict=True):
            st.record(tokens[offset : offset + st.rows], n)
            offset += st.rows
        return tokens
