"""The per-request pipeline: what happens to a request between its admission and its last output.

A request (one text) is split into sentences (segments). Each segment gets an optional refine sequence
(GPT text head) and then an audio-code sequence (GPT audio heads). With several segments and no voice
sample, the first segment's text is first spoken alone by a *voice* sequence; its audio, encoded by the
DVAE, becomes the voice sample of every segment (the reference's way of keeping one voice across
sentences). Each code sequence feeds an ``AudioStream`` whose windows the core decodes; a request's
audio leaves in segment order. A code pass whose prompt (made longer by the refine pass or the voice
sample) does not fit a KV slot is spoken in parts (``prompt_fit``), one after the other, as one sentence.
A refined text too long even in parts is spoken unrefined (the refine pass is an enhancement); a sentence
that cannot fit unrefined either ends its request as the client's error (``RequestOutput.bad_input``).

The pipeline holds state and makes sequences; it runs no model. ``EngineCore`` queues the sequences it
returns, runs the model, and hands results back.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

import numpy as np
import torch

from ..audio.policy import StreamPolicy
from ..audio.stream import AudioStream, Window
from ..device import pinned_copy
from ..models.chattts.config import AUDIO_EOS, SAMPLE_RATE
from ..models.chattts.speaker import encode_prompt_codes, normalized_speaker_embedding
from ..models.chattts.tokenizer import Tokenizer, code_prompt, refine_prompt
from .hidden_store import HiddenStore, rows_for
from .input_processor import PreparedRequest
from .outputs import RequestOutput, SegmentResult, SegmentSpan, StepOutput
from .prompt_fit import Part, fit
from .request import FinishReason, Sequence, SequenceStatus
from .runner import SeqInputs, StepSampling

logger = logging.getLogger(__name__)
_TAG = re.compile(r"\[[^\[\]]*\]")
VOICE_TEXT_ROOM = 64
"""Text positions the voice step leaves every later pass (beyond their min_new_tokens): a longer text of
theirs is cut in parts (``prompt_fit``)."""


@dataclass(eq=False)
class _Segment:
    index: int
    """Position in the request; -1 for the voice step's segment (spoken, never emitted)."""
    text: str
    refined_text: str | None = None
    unrefined: bool = False
    """The refine pass's text did not fit a slot even in parts: the sentence is spoken as normalised."""
    stream: AudioStream | None = None
    hidden_row: int | None = None
    """The stream's row of the pipeline's ``HiddenStore`` while it needs its hidden states."""
    pcm: list[np.ndarray] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    code_queued: bool = False
    fitted: Part | None = None
    """The code pass's text and lengths once fitted to a slot (``prompt_fit``)."""
    parts: list[_Segment] = field(default_factory=list)
    """A segment spoken in several code passes: one per part, in order (empty: the segment's own pass)."""

    @property
    def spoken_text(self) -> str:
        return self.refined_text if self.refined_text is not None else self.text

    @property
    def units(self) -> list[_Segment]:
        """What carries the segment's audio: its parts, or itself."""
        return self.parts or [self]


@dataclass(eq=False)
class _Request:
    request_id: str
    prepared: PreparedRequest
    policy: StreamPolicy
    priority: int
    arrival: float
    speaker: torch.Tensor | None
    """Normalised speaker embedding on the device."""
    segments: list[_Segment]
    sample_codes: torch.Tensor | None
    """Voice-sample codes [T_s, 4] of every code pass: the request's own, or the voice step's."""
    sample_text: str
    voice: _Segment | None = None
    """The voice step's segment while it is pending or running."""
    voice_sample: str | None = None
    emit_index: int = 0
    status: FinishReason | None = None
    """Set when the request ends early ("aborted", "error")."""
    error: str | None = None
    bad_input: bool = False
    """The error is the request's own (its text cannot fit a slot), not the engine's."""
    num_steps: int = 0
    samples_out: int = 0
    """Samples emitted so far: where the next sentence starts (sentences are back to back, see ``outputs``)."""
    spans: list[SegmentSpan] = field(default_factory=list)

    @property
    def params(self):
        return self.prepared.params

    def live_segments(self) -> list[_Segment]:
        """Every code pass's segment (or part) and the voice step's."""
        return [*(u for s in self.segments for u in s.units), *([self.voice] if self.voice is not None else [])]


class RequestPipeline:
    def __init__(
        self, tokenizer: Tokenizer, hidden_size: int, num_vq: int, max_model_len: int, device, num_slots: int = 16
    ) -> None:
        """``num_slots``: the engine's KV slots (the hidden-state store holds as many streams, and headroom)."""
        self.tokenizer = tokenizer
        self.hidden_size, self.num_vq = hidden_size, num_vq
        self.max_model_len = max_model_len
        self.device = device
        self.hidden_store = HiddenStore(hidden_size, max_model_len, device, rows=rows_for(num_slots))
        self.requests: dict[str, _Request] = {}
        self._by_seq: dict[int, tuple[_Request, _Segment]] = {}
        self._failed: list[str] = []

    # ------------------------------------------------------------------ lifecycle

    def start(
        self, request_id: str, prepared: PreparedRequest, policy: StreamPolicy, priority: int, arrival: float
    ) -> list[Sequence]:
        """Register a request; returns its first sequences (to queue, with refusal allowed)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already running")
        speaker = None
        if prepared.speaker is not None:
            # Through pinned memory: a pageable upload would block the engine thread on the device.
            speaker = pinned_copy(normalized_speaker_embedding(torch.from_numpy(prepared.speaker)), self.device)
        req = _Request(
            request_id,
            prepared,
            policy,
            priority,
            arrival,
            speaker,
            [_Segment(i, t) for i, t in enumerate(prepared.segments)],
            prepared.sample_codes,
            prepared.params.speaker_sample_text,
        )
        if prepared.voice_step:
            req.voice = _Segment(-1, prepared.segments[0])
        self._check_room(req)
        if req.params.refine_text:  # every segment's refine pass; code passes follow as texts are ready
            first = [(seg, self._new_sequence(req, seg)) for seg in req.segments]
        else:
            todo = [req.voice] if req.voice is not None else req.segments
            first = [(unit, self._new_sequence(req, unit)) for seg in todo for unit in self._fit(req, seg)]
            for seg in todo:
                seg.code_queued = True
        self.requests[request_id] = req
        for seg, seq in first:
            self._by_seq[seq.seq_id] = (req, seg)
        return [seq for _, seq in first]

    def drop(self, request_id: str) -> None:
        """Forget a request entirely (its sequences were refused or have left the scheduler)."""
        req = self.requests.pop(request_id, None)
        if req is not None:
            for seq_id in [k for k, (r, _) in self._by_seq.items() if r is req]:
                del self._by_seq[seq_id]
            for seg in req.live_segments():
                self._close_stream(seg)

    def _close_stream(self, seg: _Segment) -> None:
        """Give the segment's hidden-state row back (its stream decodes nothing more from it)."""
        if seg.hidden_row is not None:
            self.hidden_store.release(seg.hidden_row)
            seg.hidden_row = None

    def end(self, request_id: str, status: FinishReason, error: str | None = None, bad_input: bool = False) -> bool:
        """End a request early ("aborted" or "error"; ``bad_input``: the request's fault); its final output
        follows. False if not running."""
        req = self.requests.get(request_id)
        if req is None or req.status is not None:
            return False
        req.status, req.error, req.bad_input = status, error, bad_input
        return True

    def has_requests(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------ sequences

    def _new_sequence(self, req: _Request, seg: _Segment) -> Sequence:
        p = req.params
        if seg.fitted is None:  # its refine pass (a code pass is fitted to a slot first: ``_fit``)
            r = p.refine
            ids = self.tokenizer.encode(refine_prompt(seg.text, r.prompt))
            sampling = StepSampling((float(r.temperature),), r.top_p, r.top_k, r.repetition_penalty, p.refine_seed)
            kind, eos, prompt_len = "text", self.tokenizer.eos_id, len(ids)
            inputs = SeqInputs(ids, sampling)
            min_new, max_new = r.min_new_tokens, r.max_new_tokens
        else:
            part = seg.fitted
            ids = self.tokenizer.encode(self._code_prompt(req, part.text, seg.index))
            sample = req.sample_codes
            prompt_len = len(ids) + (0 if sample is None else len(sample))
            sampling = StepSampling(p.temperatures, p.top_p, p.top_k, p.repetition_penalty, p.seed)
            kind, eos = "code", AUDIO_EOS
            inputs = SeqInputs(ids, sampling, req.speaker, self.tokenizer.spk_emb_id, sample)
            min_new, max_new = part.min_new_tokens, part.max_new_tokens
        if prompt_len + max_new > self.max_model_len:
            # max_new_tokens is a cap: shorten it to what the slot holds (at least one step).
            max_new = self.max_model_len - prompt_len
            if max_new < max(1, min_new):
                what = "the first sentence's voice step" if seg is req.voice else f"segment {seg.index}"
                raise ValueError(
                    f"{what} is too long: its prompt has {prompt_len} tokens and the engine's "
                    f"max_model_len is {self.max_model_len}"
                )
        return Sequence(
            request_id=req.request_id,
            kind=kind,
            prompt_len=prompt_len,
            min_new_tokens=min_new,
            max_new_tokens=max_new,
            eos_id=eos,
            seeded=sampling.seed is not None,
            retry_empty=p.ensure_non_empty,
            priority=req.priority,
            rank=max(seg.index, 0),
            arrival=req.arrival,
            payload=inputs,
        )

    def _code_prompt(self, req: _Request, text: str, index: int = 0) -> str:
        # Segment ``index``'s own [speed_N] (SSML at several rates); the voice step (-1) speaks segment 0's.
        return code_prompt(text, req.prepared.prompt(index), req.speaker is not None, req.sample_text)

    def _check_room(self, req: _Request) -> None:
        """Refuse up front (ValueError: a 400) a request no split can speak: its ``min_new_tokens`` and its
        shortest prompt (the template, its own voice sample, one token of text) do not fit one slot."""
        sample = 0 if req.sample_codes is None else len(req.sample_codes)
        shortest = len(self.tokenizer.encode(self._code_prompt(req, ""))) + sample + 1
        least = req.params.min_new_tokens
        if shortest + max(1, least) > self.max_model_len:
            raise ValueError(
                f"the request cannot fit the engine's max_model_len of {self.max_model_len} positions: "
                f"min_new_tokens {least} and its shortest prompt ({shortest} positions"
                f"{f', {sample} of them its voice sample' if sample else ''}) need {shortest + max(1, least)}"
            )

    def _later_room(self, req: _Request) -> int:
        """Positions the voice step leaves for each later pass's own text and audio: its min_new_tokens and
        ``VOICE_TEXT_ROOM`` of text, at most half the slot."""
        return min(self.max_model_len // 2, max(1, req.params.min_new_tokens) + VOICE_TEXT_ROOM)

    def _fit(self, req: _Request, seg: _Segment) -> list[_Segment]:
        """The segment's code passes, each fitted to a slot (``prompt_fit``): the segment itself, or its
        parts. The voice step speaks its first part only (the sample is that part's audio and text).
        Raises ValueError when no split fits."""
        sample = 0 if req.sample_codes is None else len(req.sample_codes)
        p = req.params
        # Every later pass holds the voice step's prompt and audio (the sample) again: the voice step leaves
        # them room for their min_new_tokens and some text of their own.
        parts = fit(
            seg.spoken_text,
            lambda t: len(self.tokenizer.encode(self._code_prompt(req, t, seg.index))) + sample,
            p.min_new_tokens,
            req.prepared.max_new_tokens,
            self.max_model_len - self._later_room(req) if seg is req.voice else self.max_model_len,
        )
        if parts is None:
            what = "the first sentence's voice step" if seg is req.voice else f"segment {seg.index}"
            template = len(self.tokenizer.encode(self._code_prompt(req, "", seg.index)))
            raise ValueError(
                f"{what} does not fit a slot: its prompt has {template} "
                f"positions before its text and {sample} of voice sample, min_new_tokens is {p.min_new_tokens} and "
                f"the engine's max_model_len is {self.max_model_len}"
            )
        if seg is req.voice or len(parts) == 1:
            seg.fitted = parts[0]
            if seg is req.voice:
                seg.text = parts[0].text
            return [seg]
        seg.parts = [_Segment(seg.index, part.text, fitted=part) for part in parts]
        return seg.parts

    def _fit_or_unrefined(self, req: _Request, seg: _Segment) -> list[_Segment]:
        """``_fit``; when the refined text cannot fit even in parts, the sentence's unrefined text (the refine
        pass only enhances it), said in an INFO log and in its ``SegmentResult.unrefined``. Raises ValueError
        when that does not fit either."""
        try:
            return self._fit(req, seg)
        except ValueError as exc:
            source = req.segments[max(seg.index, 0)]
            if source.refined_text is None:
                raise
            logger.info("request %s: %s; speaking its unrefined text", req.request_id, exc)
            source.refined_text, source.unrefined = None, True
            if seg is req.voice:
                seg.text = source.text
            return self._fit(req, seg)

    def _code_passes(self, req: _Request) -> list[Sequence]:
        """Every code pass whose text is ready: the voice step first (when the request has one), then,
        once its sample exists, each segment's own (or its parts'). Ends the request when one cannot be
        made."""
        todo = [req.voice] if req.voice is not None else req.segments
        out = []
        for seg in todo:
            source = req.segments[max(seg.index, 0)]
            text_ready = not req.params.refine_text or source.refined_text is not None or source.unrefined
            if seg.code_queued or not text_ready:
                continue
            try:
                seqs = [(unit, self._new_sequence(req, unit)) for unit in self._fit_or_unrefined(req, seg)]
            except ValueError as exc:  # the client's text: a 400 (or an error event), never an engine error
                logger.info("request %s: refused: %s", req.request_id, exc)
                self._fail(req.request_id, str(exc), bad_input=True)
                return []
            seg.code_queued = True
            for unit, seq in seqs:
                self._by_seq[seq.seq_id] = (req, unit)
                out.append(seq)
        return out

    # ------------------------------------------------------------------ one step's results

    def update(self, outputs: list[StepOutput], hidden: torch.Tensor | None = None) -> list[Sequence]:
        """Apply the step's tokens; returns the sequences that follow (the code pass after a refine).
        ``hidden``: the step's ``RunnerOutput.hidden`` (``StepOutput.hidden_row`` indexes it), written
        into the streams' rows at once. An error while applying one request's token ends that request
        only (see ``take_failed``)."""
        try:
            return self._update(outputs)
        finally:
            self.hidden_store.write(hidden)

    def _update(self, outputs: list[StepOutput]) -> list[Sequence]:
        follow: list[Sequence] = []
        for out in outputs:
            entry = self._by_seq.get(out.seq.seq_id)
            if entry is None or entry[0].status is not None:  # its request has ended
                continue
            req, seg = entry
            try:
                follow += self._apply(req, seg, out)
            except Exception:
                logger.exception("request %s: applying a step failed", req.request_id)
                self._fail(req.request_id)
        return follow

    def _apply(self, req: _Request, seg: _Segment, out: StepOutput) -> list[Sequence]:
        seq = out.seq
        if seq.kind == "code":
            if seg.stream is None or out.restarted:
                # The voice step's audio is decoded once, whole, as the reference decodes it.
                policy = StreamPolicy.one_shot() if seg is req.voice else req.policy
                self._close_stream(seg)
                seg.hidden_row, buffer = self.hidden_store.acquire(seq.max_new_tokens)
                seg.stream = AudioStream(policy, self.hidden_size, seq.max_new_tokens, self.device, buffer)
            if out.token is not None:
                if out.hidden_row is None:
                    raise RuntimeError(f"code sequence {seq.seq_id}: a token without its hidden state")
                self.hidden_store.stage(seg.hidden_row, seg.stream.push(out.token), out.hidden_row)
                req.num_steps += seg is not req.voice
            if out.finished:
                seg.stream.finish()
                seg.finish_reason = seq.status.finish_reason
                del self._by_seq[seq.seq_id]
            return []
        if not out.finished:
            return []
        # The refine pass is done: the segment's text is final.
        del self._by_seq[seq.seq_id]
        if seq.status == SequenceStatus.FINISHED_ABORTED:
            return []
        ids = [t[0] for t in seq.tokens if t[0] < self.tokenizer.break_0_id]
        seg.refined_text = self.tokenizer.decode(ids)
        if seg.index == 0 and req.voice is not None:
            req.voice.text = seg.refined_text  # the reference's voice step speaks the refined text
        return self._code_passes(req)

    def _fail(
        self, request_id: str, message: str = "internal error (see the server log)", bad_input: bool = False
    ) -> None:
        if self.end(request_id, "error", message, bad_input):
            self._failed.append(request_id)

    def take_failed(self) -> list[str]:
        """Requests this pipeline ended with an error since the last call (their other sequences must
        leave the scheduler)."""
        failed, self._failed = self._failed, []
        return failed

    def windows(self) -> list[tuple[str, _Segment, Window]]:
        """Every audio window ready to decode: (request id, segment, window)."""
        ready = []
        for req in self.requests.values():
            if req.status is None:
                for seg in req.live_segments():
                    if seg.stream is not None and (w := seg.stream.next_window()) is not None:
                        ready.append((req.request_id, seg, w))
        return ready

    def accept(self, windows: list[tuple[str, _Segment, Window]], pcm: list[torch.Tensor]) -> None:
        for (_, seg, w), samples in zip(windows, pcm, strict=True):
            seg.pcm.append(w.stream.accept(w, samples))
            if w.stream.done and seg.stream is w.stream:
                # Its last window is decoded: the row goes back now, not when the request's audio reaches
                # this segment in order (a later sentence can finish long before an earlier one).
                self._close_stream(seg)

    def code_rows_free(self) -> int:
        """Code sequences that may start now: each takes a hidden-state row at its first step, and the
        store never grows (``hidden_store``)."""
        return self.hidden_store.rows_free

    def voice_steps_done(self) -> list[tuple[str, np.ndarray]]:
        """(request id, waveform) of every voice step whose audio is complete."""
        done = []
        for req in self.requests.values():
            v = req.voice
            if req.status is None and v is not None and v.stream is not None and v.stream.done:
                done.append((req.request_id, np.concatenate(v.pcm) if v.pcm else np.zeros(0, np.float32)))
        return done

    def set_voice_sample(self, request_id: str, codes: torch.Tensor | None) -> list[Sequence]:
        """The voice step's DVAE codes [4, T_s] (None: too little audio, keep the speaker embedding
        only); returns the code passes that can start now."""
        req = self.requests[request_id]
        if codes is not None and codes.shape[1] > 0:
            req.sample_codes = codes.t().contiguous().long()
            req.sample_text = req.voice.text
            req.voice_sample = encode_prompt_codes(codes)
        else:
            logger.info("request %s: the first sentence gave too little audio for a voice sample", request_id)
        self._close_stream(req.voice)
        req.voice = None
        return self._code_passes(req)

    def outputs(self) -> list[RequestOutput]:
        """This step's new audio of every request, in segment order; final outputs for finished ones."""
        outputs = []
        for req in list(self.requests.values()):
            if req.status is None:
                try:
                    out = self._output(req)
                except Exception:
                    logger.exception("request %s: collecting its output failed", req.request_id)
                    self._fail(req.request_id)
                else:
                    if out is not None:
                        outputs.append(out)
                    continue
            # Aborted or failed: a final output, no more audio.
            out = RequestOutput(req.request_id, np.zeros(0, np.float32), True, req.status, req.error, req.num_steps)
            out.bad_input = req.bad_input
            outputs.append(out)
            self.drop(req.request_id)
        return outputs

    def _output(self, req: _Request) -> RequestOutput | None:
        """The request's new audio (None when it has none this step); the final output when done."""
        new, ended = [], len(req.spans)
        while req.emit_index < len(req.segments):
            seg = req.segments[req.emit_index]
            done = True
            for unit in seg.units:  # a split segment's parts in order: a part's audio waits for the one before
                new += unit.pcm
                req.samples_out += sum(len(p) for p in unit.pcm)
                unit.pcm = []
                if unit.stream is None or not unit.stream.done:
                    done = False
                    break
                self._close_stream(unit)
            if not done:
                break
            start = req.spans[-1].end if req.spans else 0
            req.spans.append(SegmentSpan(seg.index, self._caption(seg.text), start, req.samples_out, SAMPLE_RATE))
            req.emit_index += 1
        done = req.emit_index == len(req.segments)
        if not (new or done or len(req.spans) > ended):
            return None
        out = RequestOutput(req.request_id, np.concatenate(new) if new else np.zeros(0, np.float32))
        out.spans = req.spans[ended:]
        out.num_steps = req.num_steps
        if done:
            reasons = [u.finish_reason for s in req.segments for u in s.units]
            out.finished, out.finish_reason = True, "length" if "length" in reasons else "stop"
            out.voice_sample = req.voice_sample
            out.num_input_tokens = sum(len(self.tokenizer.encode(s.spoken_text)) for s in req.segments)
            out.segments = [self._result(s, span) for s, span in zip(req.segments, req.spans, strict=True)]
            self.drop(req.request_id)
        return out

    def _result(self, seg: _Segment, span: SegmentSpan) -> SegmentResult:
        """A finished segment: its parts' codes one after the other; "length" if any part hit its cap."""
        codes = [np.asarray(u.stream.codes, dtype=np.int64).reshape(-1, self.num_vq) for u in seg.units]
        reasons = [u.finish_reason for u in seg.units]
        reason = "length" if "length" in reasons else reasons[0]
        return SegmentResult(seg.spoken_text, np.concatenate(codes), reason, span, seg.unrefined)

    def _caption(self, text: str) -> str:
        """A sentence's text without the control tokens it may hold (``[uv_break]`` from SSML, ``[laugh]``)."""
        known = self.tokenizer.control_tokens
        return " ".join(_TAG.sub(lambda m: "" if m.group() in known else m.group(), text).split())
