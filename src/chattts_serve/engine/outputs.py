"""What flows between the stages of one engine step, and what leaves the engine (no torch here).

Inside a step:
SchedulerOutput  scheduler -> runner: which sequences prefill and which decode this step
RunnerOutput     runner -> scheduler: the token(s) sampled for each of them
StepOutput       scheduler -> pipeline: what each sequence gained, and whether it finished

To the user:
RequestOutput    one streamed delta of a request: its new audio, the sentences it completes (``SegmentSpan``);
                 the last one carries the ``Result``
Result           a finished request: the whole audio, each sentence's text, codes and place in the audio

Where a sentence lies in the audio is counted, never estimated: a request's audio is its sentences' audio
back to back, with no overlap, crossfade or gap between sentences (``audio.stream`` crossfades only the
chunks inside one sentence, and a sentence's chunks add up to exactly its one-shot decode, 512 * steps - 256
samples). So sentence i starts at the sum of the samples emitted for sentences 0..i-1 and ends where
sentence i+1 starts; the pipeline counts the samples it emits (``RequestPipeline._output``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .request import FinishReason, Sequence


@dataclass(frozen=True, slots=True)
class Word:
    """One word's place in its utterance's audio, in samples (counted from predicted durations: a family's
    ``Speech.words``). Here, below ``models.family``, because the engine's outputs carry it."""

    text: str
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """Prompt positions ``start .. end-1`` of ``seq`` going into its KV slot in one step (chunked prefill:
    a prompt longer than a step's prefill budget goes in over several steps, each chunk attending to the
    keys the earlier ones wrote)."""

    seq: Sequence
    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start

    @property
    def last(self) -> bool:
        """The prompt's last chunk: its sequence samples its first token in the same step."""
        return self.end == self.seq.prompt_len


@dataclass(slots=True)
class SchedulerOutput:
    prefill: list[Sequence] = field(default_factory=list)
    """Their prompt (or its last chunk) into their slot, then their first token."""
    decode: list[Sequence] = field(default_factory=list)
    """Running: one token each."""
    finished: list[Sequence] = field(default_factory=list)
    """Left the running set since the last step (aborted, or finished in the last update)."""
    partial: list[PrefillChunk] = field(default_factory=list)
    """Prompt chunks that are not their prompt's last: into the cache, no token (chunked prefill)."""
    prefill_from: dict[int, int] = field(default_factory=dict)
    """seq id -> the first prompt position a ``prefill`` sequence writes this step, where earlier steps
    wrote the positions before it (its last chunk); absent: 0, the whole prompt."""

    @property
    def is_empty(self) -> bool:
        return not self.prefill and not self.decode and not self.partial

    def chunks(self) -> list[PrefillChunk]:
        """Every prompt piece of the step: the partial chunks, then each ``prefill`` sequence's (its last)."""
        whole = (PrefillChunk(s, self.prefill_from.get(s.seq_id, 0), s.prompt_len) for s in self.prefill)
        return [*self.partial, *whole]

    def prefilling(self) -> list[Sequence]:
        """Every sequence whose prompt goes (in part) into the cache this step."""
        return [c.seq for c in self.partial] + self.prefill


@dataclass(slots=True)
class RunnerOutput:
    tokens: dict[int, tuple[int, ...]]
    """seq_id -> the sampled token (4 codes, or 1 text id)."""
    hidden: Any = None
    """``[rows, hidden]`` on the device: the hidden states that predicted the code sequences' tokens,
    one tensor for the step (not one per sequence); None when no code sequence ran."""
    hidden_rows: dict[int, int] = field(default_factory=dict)
    """seq_id -> its row of ``hidden`` (code sequences)."""
    done: dict[int, Any] = field(default_factory=dict)
    """seq_id -> the whole output of a sequence the step ran to its end (a batch family's ``Speech``)."""

    def hidden_of(self, seq_id: int) -> Any:
        """One sequence's hidden state ``[hidden]`` (a view), or None."""
        row = self.hidden_rows.get(seq_id)
        return None if row is None else self.hidden[row]


@dataclass(slots=True)
class StepOutput:
    seq: Sequence
    token: tuple[int, ...] | None
    """The kept token of this step; None when the step ended the sequence (EOS) or restarted it."""
    hidden_row: int | None = None
    """The row of the step's ``RunnerOutput.hidden`` that predicted ``token`` (code sequences)."""
    finished: bool = False
    restarted: bool = False
    """The first step was EOS and the sequence goes back to the queue for new draws."""


@dataclass(frozen=True, slots=True)
class SegmentSpan:
    """Where one sentence lies in its request's audio: samples [start, end) at ``sample_rate`` (the model's)."""

    index: int
    """The sentence's position in the request."""
    text: str
    """The sentence as normalised (before the refine pass), without control tokens such as ``[uv_break]``:
    what a caption shows. The text before normalisation is not kept past input processing."""
    start: int
    end: int
    sample_rate: int
    words: tuple[Word, ...] = ()
    """Each word's samples in the same audio (families with word timestamps; empty otherwise)."""

    @property
    def start_s(self) -> float:
        return self.start / self.sample_rate

    @property
    def end_s(self) -> float:
        return self.end / self.sample_rate

    def shifted(self, samples: int, index: int | None = None) -> SegmentSpan:
        """The same sentence ``samples`` later (in a longer stream of which the request is a part)."""
        index = self.index if index is None else index
        words = tuple(Word(w.text, w.start + samples, w.end + samples) for w in self.words)
        return SegmentSpan(index, self.text, self.start + samples, self.end + samples, self.sample_rate, words)


@dataclass(slots=True)
class SegmentResult:
    """One sentence of a finished request."""

    text: str
    """As spoken: normalised, and refined when the refine pass ran."""
    codes: np.ndarray
    """int64 [T, 4] audio codes."""
    finish_reason: FinishReason | None
    span: SegmentSpan | None = None
    """Its place in the request's audio (None only for a result built outside the engine)."""
    unrefined: bool = False
    """The refine pass ran, but its text did not fit a slot even in parts: ``text`` is the sentence unrefined."""


@dataclass(slots=True)
class Result:
    """A finished request."""

    request_id: str
    audio: np.ndarray
    """float32 mono waveform at ``sample_rate`` (empty for a request that ended before any audio)."""
    segments: list[SegmentResult]
    finish_reason: FinishReason | None
    """"stop", or "length" when a sentence hit max_new_tokens; "aborted"/"error" never reach a Result."""
    num_steps: int = 0
    """Audio steps (tokens of 4 codes) generated for the spoken sentences (the voice step's are not counted)."""
    num_input_tokens: int = 0
    """Text tokens of the spoken sentences."""
    voice_sample: str | None = None
    """The voice sample made from the first sentence when the voice step ran
    (``SamplingParams.first_sentence_voice``); pass it as ``speaker_sample`` with ``text[0]`` as
    ``speaker_sample_text`` to speak other texts in the same voice."""
    elapsed_s: float = 0.0
    """Seconds from submission to completion (in an offline batch: from the ``synthesize`` call)."""
    time_to_first_audio_s: float | None = None
    sample_rate: int = 0
    """The model's (``FamilyModel.sample_rate``); ``build_result`` takes it from the final output."""

    @property
    def codes(self) -> np.ndarray:
        """int64 [T, 4]: every sentence's codes, in order."""
        return np.concatenate([s.codes for s in self.segments]) if self.segments else np.zeros((0, 4), np.int64)

    @property
    def text(self) -> list[str]:
        """Each sentence's text as spoken."""
        return [s.text for s in self.segments]

    @property
    def spans(self) -> list[SegmentSpan]:
        """Each sentence's place in ``audio``."""
        return [s.span for s in self.segments if s.span is not None]

    @property
    def finish_reasons(self) -> list[FinishReason | None]:
        return [s.finish_reason for s in self.segments]

    @property
    def duration(self) -> float:
        return len(self.audio) / self.sample_rate


@dataclass(slots=True)
class RequestOutput:
    """One streamed delta of a request: the audio that follows the previous delta."""

    request_id: str
    audio: np.ndarray
    """New float32 PCM at ``sample_rate`` since the previous output; may be empty."""
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    bad_input: bool = False
    """With ``finish_reason`` "error": the request's own input could not be spoken (a text that fits no slot,
    found only once the engine ran it): the client's error, not the engine's."""
    num_steps: int = 0
    """Audio steps generated so far (spoken sentences)."""
    segments: list[SegmentResult] | None = None
    """On the last output of a completed request: each sentence's text, codes and span."""
    num_input_tokens: int = 0
    """On the last output: text tokens of the spoken sentences."""
    voice_sample: str | None = None
    """On the last output: the voice sample the voice step made (see ``Result.voice_sample``)."""
    index: int = 0
    """Position of this delta among the request's streamed outputs (set by ``AsyncEngine.stream``)."""
    start_sample: int = 0
    """Position of this delta's first sample in the request's audio (set by ``AsyncEngine.stream``)."""
    elapsed_s: float = 0.0
    """Seconds from submission to this delta (set by ``AsyncEngine.stream``)."""
    sample_rate: int = 0
    """The model's (``FamilyModel.sample_rate``): set on every output by ``EngineCore.step``."""
    spans: list[SegmentSpan] = field(default_factory=list)
    """The sentences whose audio ends in this delta (or before it), each once, in order."""
    stretches: tuple[tuple[int, float], ...] | None = None
    """This delta's audio as (samples, time-stretch factor) runs, in order, when its request's segments have
    factors of their own (``PreparedRequest.stretches``: SSML rates with ``speed_mode`` "stretch"); set by
    ``AsyncEngine.stream``. None: the response's one factor."""


def build_result(
    final: RequestOutput, audio: np.ndarray, elapsed_s: float, time_to_first_audio_s: float | None = None
) -> Result:
    """The ``Result`` of a completed request from its last output and all its audio."""
    return Result(
        final.request_id,
        audio,
        final.segments or [],
        final.finish_reason,
        final.num_steps,
        final.num_input_tokens,
        final.voice_sample,
        elapsed_s,
        time_to_first_audio_s,
        final.sample_rate,
    )
