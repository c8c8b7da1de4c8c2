"""``EngineCore``: one engine step = schedule -> run the model -> update -> audio.

A request (one text) is split into sentences (segments). Each segment gets an optional refine sequence
(GPT text head) and then an audio-code sequence (GPT audio heads); all sequences of all requests share
the continuous batch. With several segments and no voice sample, the first segment's text is first
spoken alone by a *voice* sequence whose audio, encoded by the DVAE, becomes the voice sample of every
segment (the reference's way of keeping one voice across sentences). Each code sequence feeds an
``AudioStream``, whose windows are decoded (Decoder + Vocos) batched across every stream that has one
ready this step. A request's audio leaves in segment order. The core is single-threaded and synchronous:
``Engine`` drives it to completion offline, ``AsyncEngine`` runs it in a background thread for serving.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..audio.decode import decode_windows
from ..audio.stream import AudioStream, StreamPolicy
from ..model.checkpoint import LoadedModel
from ..model.config import AUDIO_EOS
from ..model.speaker import decode_prompt_codes, decode_speaker, encode_prompt_codes, normalized_speaker_embedding
from ..model.tokenizer import Tokenizer, code_prompt, refine_prompt
from ..sampling_params import SamplingParams
from ..text.normalize import Normalizer, split_text
from .cuda_graph import RunnerConfig
from .outputs import StepOutput
from .request import FinishReason, Sequence, SequenceStatus
from .runner import ModelRunner, SeqInputs, StepSampling
from .scheduler import Scheduler, SchedulerConfig

logger = logging.getLogger(__name__)

MAX_TEXT_CHARS = 20_000
MIN_VOICE_SAMPLES = 2048
"""Least first-sentence audio (4 steps) the voice step encodes into a sample; less: no sample."""


@dataclass(slots=True)
class PreparedRequest:
    """Host-side work done before a request reaches the engine loop (normalise, split, validate)."""

    segments: list[str]
    params: SamplingParams
    speaker: np.ndarray | None  # float16 [hidden]
    sample_codes: torch.Tensor | None  # [T_s, 4]
    voice_step: bool = False
    """Speak the first segment alone first and use its audio as every segment's voice sample."""


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    audio: np.ndarray
    """New PCM since the previous output (float32, 24 kHz); may be empty."""
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    num_steps: int = 0
    """Audio steps generated so far (all segments)."""
    segments: list[SegmentResult] | None = None
    """On the final output of a completed request: each sentence's text and codes."""
    voice_sample: str | None = None
    """On the final output: the voice sample made from the first sentence (prompt-codes string, usable
    as ``SamplingParams.speaker_sample`` with the first sentence's text), when the voice step ran."""


@dataclass(slots=True)
class SegmentResult:
    text: str
    """As spoken: normalised, and refined when the refine pass ran."""
    codes: np.ndarray
    """int64 [T, 4]."""
    finish_reason: FinishReason | None


@dataclass(eq=False)
class _Segment:
    index: int
    text: str
    stream: AudioStream | None = None
    seq: Sequence | None = None
    refined_text: str | None = None
    pcm: list[np.ndarray] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    code_queued: bool = False

    @property
    def spoken_text(self) -> str:
        return self.refined_text if self.refined_text is not None else self.text


@dataclass(eq=False)
class _Job:
    request_id: str
    prepared: PreparedRequest
    policy: StreamPolicy
    priority: int
    arrival: float
    speaker: torch.Tensor | None
    segments: list[_Segment]
    voice: _Segment | None = None
    """The voice step's segment while it is pending or running (never emitted)."""
    sample_codes: torch.Tensor | None = None
    """Voice-sample codes [T_s, 4] of every code pass: the request's own, or the voice step's."""
    sample_text: str = ""
    voice_sample: str | None = None
    emit_index: int = 0
    status: FinishReason | None = None
    error: str | None = None
    num_steps: int = 0

    @property
    def params(self) -> SamplingParams:
        return self.prepared.params


class EngineCore:
    def __init__(
        self,
        model: LoadedModel,
        tokenizer: Tokenizer,
        scheduler_config: SchedulerConfig,
        runner_config: RunnerConfig | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.normalizer = Normalizer()
        self.scheduler = Scheduler(scheduler_config)
        self.runner = ModelRunner(
            model, scheduler_config.max_num_seqs, scheduler_config.max_model_len, tokenizer.eos_id, runner_config
        )
        self.jobs: dict[str, _Job] = {}
        self._seq_segment: dict[int, tuple[_Job, _Segment]] = {}
        self.device = self.runner.device

    # ------------------------------------------------------------------ request preparation

    def prepare(self, text: str, params: SamplingParams) -> PreparedRequest:
        """Validate and normalise one text (thread-safe; no device work). Raises ValueError."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if not isinstance(text, str):
            raise ValueError(f"text must be a string, got {type(text).__name__}")
        if not text.strip():
            raise ValueError("text is empty")
        if len(text) > MAX_TEXT_CHARS:
            raise ValueError(f"text has {len(text)} characters; the limit is {MAX_TEXT_CHARS}")
        for what, value in (("text", text), ("prompt", params.prompt), ("refine.prompt", params.refine.prompt)):
            unknown = self.tokenizer.unknown_tags(value)
            if unknown:
                known = ", ".join(sorted(self.tokenizer.control_tokens))
                raise ValueError(f"{what} has unknown control token(s) {', '.join(unknown)}; known: {known}")
        pieces = split_text(text) if params.split_text else [text]
        segments = []
        for piece in pieces:
            norm = self.normalizer(piece, params.do_text_normalization, params.do_homophone_replacement, params.lang)
            if norm.strip():
                segments.append(norm)
        if not segments:
            raise ValueError(f"nothing to speak after normalisation: {text!r}")
        hidden = self.model.config.gpt.hidden_size
        speaker = decode_speaker(params.speaker, expected_dim=hidden) if params.speaker is not None else None
        sample = None
        if params.speaker_sample is not None:
            sample = decode_prompt_codes(params.speaker_sample).t().contiguous()  # [T_s, 4]
            if sample.numel() == 0 or sample.shape[1] != self.model.config.gpt.num_vq or int(sample.max()) >= AUDIO_EOS:
                raise ValueError("speaker_sample does not hold valid [4, T] audio codes")
        voice_step = params.split_text and params.first_sentence_voice and sample is None and len(segments) > 1
        return PreparedRequest(segments, params, speaker, sample, voice_step)

    # ------------------------------------------------------------------ submission and abort

    def add_request(
        self,
        request_id: str,
        prepared: PreparedRequest,
        policy: StreamPolicy | None = None,
        priority: int = 0,
        arrival: float | None = None,
    ) -> None:
        """Queue a prepared request. Raises ValueError (bad request, duplicate id) or QueueFullError."""
        if request_id in self.jobs:
            raise ValueError(f"request id {request_id!r} is already running")
        speaker = None
        if prepared.speaker is not None:
            speaker = normalized_speaker_embedding(torch.from_numpy(prepared.speaker)).to(self.device)
        job = _Job(
            request_id,
            prepared,
            policy or StreamPolicy.one_shot(),
            priority,
            time.monotonic() if arrival is None else arrival,
            speaker,
            [_Segment(i, t) for i, t in enumerate(prepared.segments)],
            sample_codes=prepared.sample_codes,
            sample_text=prepared.params.speaker_sample_text,
        )
        if prepared.voice_step:
            job.voice = _Segment(-1, prepared.segments[0])
        if job.params.refine_text:  # every segment's refine pass; code passes follow as texts are ready
            first = job.segments
        else:
            first = [job.voice] if job.voice is not None else job.segments
        seqs = [self._new_sequence(job, seg) for seg in first]
        queued = []
        try:
            for seq in seqs:
                self.scheduler.add(seq)
                queued.append(seq)
        except Exception:
            for seq in queued:
                self.scheduler.abort(seq.request_id)
            raise
        self.jobs[request_id] = job
        for seq, seg in zip(seqs, first, strict=True):
            self._seq_segment[seq.seq_id] = (job, seg)
            seg.code_queued = seq.kind == "code"

    def abort(self, request_id: str) -> bool:
        """Stop a request: its sequences leave at the next step; it finishes with reason "aborted"."""
        job = self.jobs.get(request_id)
        if job is None or job.status is not None:
            return False
        self.scheduler.abort(request_id)
        job.status = "aborted"
        return True

    def has_unfinished(self) -> bool:
        return bool(self.jobs) or self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ sequences

    def _new_sequence(self, job: _Job, seg: _Segment) -> Sequence:
        p = job.params
        cfg = self.scheduler.config
        if p.refine_text and seg.refined_text is None and seg is not job.voice:
            r = p.refine
            ids = self.tokenizer.encode(refine_prompt(seg.text, r.prompt))
            sampling = StepSampling(
                (float(r.temperature),),
                r.top_p,
                r.top_k,
                r.repetition_penalty,
                r.min_new_tokens,
                r.max_new_tokens,
                p.refine_seed,
                p.ensure_non_empty,
            )
            kind, eos, prompt_len = "text", self.tokenizer.eos_id, len(ids)
            inputs = SeqInputs(ids, sampling)
        else:
            has_speaker = job.speaker is not None
            ids = self.tokenizer.encode(code_prompt(seg.spoken_text, p.prompt, has_speaker, job.sample_text))
            sample = job.sample_codes
            prompt_len = len(ids) + (0 if sample is None else len(sample))
            sampling = StepSampling(
                p.temperatures,
                p.top_p,
                p.top_k,
                p.repetition_penalty,
                p.min_new_tokens,
                p.max_new_tokens,
                p.seed,
                p.ensure_non_empty,
            )
            kind, eos = "code", AUDIO_EOS
            inputs = SeqInputs(ids, sampling, job.speaker, self.tokenizer.spk_emb_id, sample)
        max_new = sampling.max_new_tokens
        if prompt_len + max_new > cfg.max_model_len:
            # max_new_tokens is a cap: shorten it to what the slot holds (at least one step).
            max_new = cfg.max_model_len - prompt_len
            if max_new < max(1, sampling.min_new_tokens):
                raise ValueError(
                    f"segment {seg.index} is too long: its prompt has {prompt_len} tokens and the engine's "
                    f"max_model_len is {cfg.max_model_len}"
                )
        return Sequence(
            request_id=job.request_id,
            kind=kind,
            prompt_len=prompt_len,
            min_new_tokens=sampling.min_new_tokens,
            max_new_tokens=max_new,
            eos_id=eos,
            seeded=sampling.seed is not None,
            retry_empty=sampling.ensure_non_empty,
            priority=job.priority,
            arrival=job.arrival,
            payload=inputs,
        )

    # ------------------------------------------------------------------ one step

    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        step_outputs: list[StepOutput] = []
        if not sched.is_empty:
            try:
                result = self.runner.execute(sched)
            except Exception as exc:  # a device error fails this step's requests, never the engine
                logger.exception("model step failed")
                for seq in (*sched.prefill, *sched.decode):
                    self._fail(self._seq_segment[seq.seq_id][0], f"model step failed: {exc}")
                result = None
            if result is not None:
                step_outputs = self.scheduler.update(sched, result)
        else:
            self.runner.execute(sched)  # drops the state of finished sequences
        for out in step_outputs:
            self._on_step(out)
        self._decode_audio()
        self._finish_voice_steps()
        return self._collect_outputs()

    def _on_step(self, out: StepOutput) -> None:
        job, seg = self._seq_segment[out.seq.seq_id]
        seq = out.seq
        if job.status is not None:
            return
        if seq.kind == "code":
            if seg.stream is None or out.restarted:
                # The voice step's audio is decoded once, whole, as the reference decodes it.
                policy = StreamPolicy.one_shot() if seg is job.voice else job.policy
                seg.stream = AudioStream(policy, self.model.config.gpt.hidden_size, seq.max_new_tokens, self.device)
            if out.token is not None:
                seg.stream.push(out.token, out.hidden)
                job.num_steps += seg is not job.voice
            if out.finished:
                seg.stream.finish()
                seg.finish_reason = seq.status.finish_reason
                self._seq_segment.pop(seq.seq_id, None)
            return
        if out.finished:  # refine pass done: queue the segment's audio pass
            self._seq_segment.pop(seq.seq_id, None)
            if seq.status == SequenceStatus.FINISHED_ABORTED:
                return
            ids = [t[0] for t in seq.tokens if t[0] < self.tokenizer.break_0_id]
            seg.refined_text = self.tokenizer.decode(ids)
            if seg.index == 0 and job.voice is not None:
                job.voice.text = seg.refined_text  # the reference's voice step speaks the refined text
            self._queue_code_passes(job)

    def _queue_code_passes(self, job: _Job) -> None:
        """Queue every code pass whose text is ready: the voice step first (when the request has one),
        then, once its sample exists, each segment's own."""
        p = job.params
        todo = [job.voice] if job.voice is not None else job.segments
        for seg in todo:
            text_ready = not p.refine_text or job.segments[max(seg.index, 0)].refined_text is not None
            if seg.code_queued or not text_ready:
                continue
            try:
                code_seq = self._new_sequence(job, seg)
                self.scheduler.add(code_seq, continuation=True)
            except Exception as exc:
                self._fail(job, str(exc))
                return
            seg.code_queued = True
            self._seq_segment[code_seq.seq_id] = (job, seg)

    def _finish_voice_step(self, job: _Job) -> None:
        """The voice step's audio is complete: encode it into the voice sample of every segment."""
        voice = job.voice
        wav = np.concatenate(voice.pcm) if voice.pcm else np.zeros(0, np.float32)
        codes = None
        if len(wav) >= MIN_VOICE_SAMPLES:
            with torch.inference_mode():
                codes = self.model.dvae.encode(torch.from_numpy(wav).to(self.device)).cpu()  # [4, T_s]
        if codes is not None and codes.shape[1] > 0:
            job.sample_codes = codes.t().contiguous().long()
            job.sample_text = voice.text
            job.voice_sample = encode_prompt_codes(codes)
        else:  # too little audio to take a voice from: every segment keeps the speaker embedding only
            logger.info("request %s: first sentence gave %d samples; no voice sample", job.request_id, len(wav))
        job.voice = None
        self._queue_code_passes(job)

    def _fail(self, job: _Job, message: str) -> None:
        if job.status is None:
            job.status, job.error = "error", message
            self.scheduler.abort(job.request_id)

    def _decode_audio(self) -> None:
        windows = []
        for job in self.jobs.values():
            if job.status is not None:
                continue
            for seg in (*job.segments, *([job.voice] if job.voice is not None else [])):
                if seg.stream is not None and (w := seg.stream.next_window()) is not None:
                    windows.append((seg, w))
        if not windows:
            return
        try:
            pcm = decode_windows(self.model, [w for _, w in windows])
        except Exception as exc:
            logger.exception("audio decode failed")
            for seg, _ in windows:
                self._fail(self._job_of(seg), f"audio decode failed: {exc}")
            return
        for (seg, w), samples in zip(windows, pcm, strict=True):
            seg.pcm.append(w.stream.accept(w, samples))

    def _finish_voice_steps(self) -> None:
        for job in list(self.jobs.values()):
            if job.status is None and job.voice is not None and job.voice.stream is not None and job.voice.stream.done:
                try:
                    self._finish_voice_step(job)
                except Exception as exc:
                    logger.exception("voice step failed")
                    self._fail(job, f"voice step failed: {exc}")

    def _job_of(self, seg: _Segment) -> _Job:
        return next(j for j in self.jobs.values() if seg in j.segments or seg is j.voice)

    def _collect_outputs(self) -> list[RequestOutput]:
        outputs = []
        for job in list(self.jobs.values()):
            if job.status is not None:  # aborted or failed: final output, no more audio
                outputs.append(
                    RequestOutput(job.request_id, np.zeros(0, np.float32), True, job.status, job.error, job.num_steps)
                )
                self._drop(job)
                continue
            new = []
            while job.emit_index < len(job.segments):
                seg = job.segments[job.emit_index]
                new += seg.pcm
                seg.pcm = []
                if seg.stream is not None and seg.stream.done:
                    job.emit_index += 1
                else:
                    break
            done = job.emit_index == len(job.segments)
            if new or done:
                out = RequestOutput(job.request_id, np.concatenate(new) if new else np.zeros(0, np.float32))
                out.num_steps = job.num_steps
                if done:
                    reasons = [s.finish_reason for s in job.segments]
                    out.finished, out.finish_reason = True, "length" if "length" in reasons else "stop"
                    out.voice_sample = job.voice_sample
                    out.segments = [
                        SegmentResult(
                            s.spoken_text,
                            np.asarray(s.stream.codes, dtype=np.int64).reshape(-1, self.model.config.gpt.num_vq),
                            s.finish_reason,
                        )
                        for s in job.segments
                    ]
                outputs.append(out)
            if done:
                self._drop(job)
        return outputs

    def _drop(self, job: _Job) -> None:
        self.jobs.pop(job.request_id, None)
        for seq_id in [k for k, (j, _) in self._seq_segment.items() if j is job]:
            self._seq_segment.pop(seq_id)
