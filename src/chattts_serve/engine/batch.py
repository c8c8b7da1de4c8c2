"""``BatchStage``: the engine's execution of a "batch" model family (``models.family.BatchModel``).

A request's text becomes utterances (the family's input processing: sentences, or chunks that fit its
context), one ``kind="utterance"`` sequence each, whose ``prompt_len`` is its work units. The scheduler admits
a step's batch by a work budget (``SchedulerConfig.admission="work"``), ``synthesize`` runs the batch, across
requests, to audio in one call, and the request's audio leaves in utterance order as each is done: streaming by
sentence. Where each utterance (and, when the family counts them, each word) lies in the request's audio is
counted in samples at the family's rate, as for ChatTTS's sentences.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..audio.policy import StreamPolicy
from ..models.family import BatchModel, Speech, Utterance, Word
from .config import EngineConfig
from .outputs import RequestOutput, RunnerOutput, SchedulerOutput, SegmentResult, SegmentSpan, StepOutput
from .request import FinishReason, Sequence, SequenceStatus

logger = logging.getLogger(__name__)


def pads_rows(device: torch.device | str) -> bool:
    """Whether a batch family's model runs a step's utterances as one padded forward on ``device``, or one forward
    each (the engine always hands it the whole batch: the scheduler's batching across requests is the same).

    The one rule every batch family's model follows (Kokoro's ``LoadedKokoro.synthesize``, VITS's decoder groups):
    not on a CPU. A CPU thread's convolutions are compute-bound already at batch 1, so a padded batch only adds
    the padding's work and memory traffic: measured at one thread, Kokoro's 8 rows of 8-100 phonemes took 3.8x
    longer padded than one by one (8 x 40 phonemes: 1.6x), VITS's decoder 4 rows of one length 14 % longer
    together. An accelerator, underused by one utterance, takes the batch. Either way a row's result is its
    batch-1 result (the families' batch invariance), so this is a speed rule only.
    """
    return torch.device(device).type != "cpu"


@dataclass(slots=True)
class BatchRequest:
    """A batch family's prepared request (``BatchStage.prepare``)."""

    segments: list[Utterance]
    """Its utterances in speaking order (the queue bound counts one sequence each)."""
    params: object
    max_samples: int
    """Its audio budget in samples: the engine's ``max_audio_seconds`` or the tighter one it was prepared with."""
    stretches: tuple[float, ...] | None = None
    """No per-run stretch factors (``PreparedRequest.stretches``): a batch family speaks an SSML rate with its
    own speed (Kokoro, VITS), so the response's stretch is the request's alone."""


@dataclass(eq=False)
class _Request:
    request_id: str
    utterances: list[Utterance]
    speech: list[Speech | None]
    max_samples: int
    emit_index: int = 0
    samples_out: int = 0
    spans: list[SegmentSpan] = field(default_factory=list)
    status: FinishReason | None = None
    error: str | None = None


class BatchStage:
    runs_ahead = False

    def __init__(self, model: BatchModel, config: EngineConfig) -> None:
        self.model = model
        self.config = config
        self.device = getattr(model, "device", torch.device("cpu"))
        self.sample_rate = model.sample_rate
        self.requests: dict[str, _Request] = {}
        self._by_seq: dict[int, tuple[_Request, int]] = {}
        self._failed: list[str] = []

    # ------------------------------------------------------------------ requests

    def prepare(self, text: str, params, max_audio_seconds: float | None = None) -> BatchRequest:
        """``max_audio_seconds``: a budget tighter than the engine's. A batch family's durations are known only
        once its model has run, so the budget is held on the output: the audio past it is cut, the utterances
        after it are never run, and the request finishes with "length" (as a ChatTTS request at its cap)."""
        utterances = self.model.utterances(text, params)
        if not utterances:
            raise ValueError(f"nothing to speak: {text!r}")
        limit = self.config.max_audio_seconds
        if max_audio_seconds is not None:
            limit = min(limit, max_audio_seconds)
        return BatchRequest(list(utterances), params, max(1, round(limit * self.sample_rate)))

    def start(
        self, request_id: str, prepared: BatchRequest, policy: StreamPolicy, priority: int, arrival: float
    ) -> list[Sequence]:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already running")
        req = _Request(request_id, prepared.segments, [None] * len(prepared.segments), prepared.max_samples)
        seed = getattr(prepared.params, "seed", None)
        seqs = [
            Sequence(
                request_id=request_id,
                kind="utterance",
                prompt_len=u.work,
                min_new_tokens=0,
                max_new_tokens=0,
                eos_id=-1,
                seeded=seed is not None,
                retry_empty=False,
                priority=priority,
                rank=i,
                arrival=arrival,
                payload=u,
            )
            for i, u in enumerate(prepared.segments)
        ]
        self.requests[request_id] = req
        for i, seq in enumerate(seqs):
            self._by_seq[seq.seq_id] = (req, i)
        return seqs

    def end(self, request_id: str, status: FinishReason, error: str | None = None) -> bool:
        req = self.requests.get(request_id)
        if req is None or req.status is not None:
            return False
        req.status, req.error = status, error
        return True

    def drop(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is not None:
            for seq_id in [k for k, (r, _) in self._by_seq.items() if r is req]:
                del self._by_seq[seq_id]

    def take_failed(self) -> list[str]:
        failed, self._failed = self._failed, []
        return failed

    # ------------------------------------------------------------------ one step

    def execute(self, sched: SchedulerOutput) -> RunnerOutput | None:
        batch = [seq for seq in sched.prefill if not seq.status.is_finished]
        if not batch:
            return None
        speech = self.model.synthesize([seq.payload for seq in batch])
        if len(speech) != len(batch):
            raise RuntimeError(f"the model returned {len(speech)} results for a batch of {len(batch)}")
        return RunnerOutput(tokens={}, done={seq.seq_id: s for seq, s in zip(batch, speech, strict=True)})

    def update(self, updates: list[StepOutput], result: RunnerOutput | None) -> list[Sequence]:
        done = result.done if result is not None else {}
        for out in updates:
            entry = self._by_seq.pop(out.seq.seq_id, None)
            if entry is None or entry[0].status is not None or out.seq.status == SequenceStatus.FINISHED_ABORTED:
                continue
            req, i = entry
            speech = done.get(out.seq.seq_id)
            audio = None if speech is None else np.asarray(speech.audio)
            if audio is None or audio.ndim != 1:
                self._fail(req, f"the model gave no 1-D waveform for utterance {i}")
                continue
            req.speech[i] = Speech(audio.astype(np.float32, copy=False), speech.words)
        return []

    def audio(self, wait: bool) -> list[Sequence]:
        return []  # the model's output is audio already

    def outputs(self) -> list[RequestOutput]:
        outputs = []
        for req in list(self.requests.values()):
            if req.status is None:
                out = self._output(req)
                if out is not None:
                    outputs.append(out)
                continue
            outputs.append(RequestOutput(req.request_id, np.zeros(0, np.float32), True, req.status, req.error))
            self.drop(req.request_id)
        return outputs

    def _output(self, req: _Request) -> RequestOutput | None:
        """The utterances done since the last output, in order; the final output when all are."""
        new, ended, cut = [], len(req.spans), False
        while req.emit_index < len(req.utterances) and (speech := req.speech[req.emit_index]) is not None:
            start = req.samples_out
            audio = speech.audio[: req.max_samples - start]  # the request's audio budget holds across utterances
            cut = len(audio) < len(speech.audio) or (
                start + len(audio) >= req.max_samples and req.emit_index + 1 < len(req.utterances)
            )
            req.samples_out += len(audio)
            words = tuple(
                Word(w.text, w.start + start, min(w.end, len(audio)) + start)
                for w in speech.words
                if w.start < len(audio)
            )
            text = req.utterances[req.emit_index].text
            req.spans.append(SegmentSpan(req.emit_index, text, start, req.samples_out, self.sample_rate, words))
            new.append(audio)
            req.emit_index += 1
            if cut:
                break
        done = cut or req.emit_index == len(req.utterances)
        if not (new or done):
            return None
        out = RequestOutput(req.request_id, np.concatenate(new) if new else np.zeros(0, np.float32))
        out.spans = req.spans[ended:]
        if done:
            reason: FinishReason = "length" if cut else "stop"
            out.finished, out.finish_reason = True, reason
            out.num_input_tokens = sum(u.work for u in req.utterances)
            empty = np.zeros((0, 0), np.int64)  # no codes: a batch family's units are its own
            spoken = req.utterances[: len(req.spans)]
            out.segments = [
                SegmentResult(u.text, empty, reason, span) for u, span in zip(spoken, req.spans, strict=True)
            ]
            if cut:  # the utterances past the budget leave the scheduler unrun (``take_failed``: ended by the stage)
                self._failed.append(req.request_id)
            self.drop(req.request_id)
        return out

    def _fail(self, req: _Request, message: str) -> None:
        logger.error("request %s: %s", req.request_id, message)
        if self.end(req.request_id, "error", message):
            self._failed.append(req.request_id)

    def reset(self) -> None:
        self._by_seq.clear()

    def close(self) -> None:
        pass  # no threads of its own

    def counters(self) -> dict[str, int]:
        return self.model.counters()

    def code_room(self) -> int | None:
        return None

    def launch(self, sched: SchedulerOutput) -> Any:
        raise NotImplementedError("a batch family runs whole utterances: no step to run ahead")

    def collect(self, launched: Any) -> RunnerOutput:
        raise NotImplementedError("a batch family runs whole utterances: no step to run ahead")
