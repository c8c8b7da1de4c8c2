"""Pitch-preserving time stretch of one audio stream, chunk by chunk (FFmpeg's ``atempo`` filter through PyAV).

OpenAI's ``speed`` (0.25-4) maps to ChatTTS's ``[speed_N]`` prompt, which the model obeys weakly. A request
may instead (``speed_mode`` "stretch") or as well ("both") have its audio stretched by the factor ``speed``:
``atempo`` is a WSOLA time stretch, so the voice keeps its pitch. A response's audio arrives in chunks, and
stretching each chunk on its own would restart the overlap-add at every join (a click and a few ms lost or
added each time); one ``StreamingStretcher`` per response keeps the filter graph, and with it atempo's
window and phase, across chunks, so the joined output is the one-shot output, sample for sample
(tests/audio/test_stretch.py). It runs before the resampler and encoder, so every format gets it.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from itertools import pairwise
from typing import Literal

import numpy as np

from ..sampling_params import speed_prompt
from .resample import mono_frame

SpeedMode = Literal["prompt", "stretch", "both"]
SPEED_MODES: tuple[str, ...] = ("prompt", "stretch", "both")
"""How a request's ``speed`` is had: "prompt" ``[speed_N]`` (the default: the model's own pace, as before),
"stretch" (the audio time-stretched by ``speed``), "both" (the prompt, then the stretch on top)."""
MIN_SPEED, MAX_SPEED = 0.25, 4.0
"""OpenAI's bounds of ``speed``."""
_ATEMPO_RANGE = (0.5, 2.0)
"""Each atempo's factor is kept here: FFmpeg before 4.3 refused anything else, and past 2 atempo skips input
rather than overlapping it; a factor outside is a chain (0.25 = 0.5 x 0.5, 4 = 2 x 2)."""


@dataclass(frozen=True, slots=True)
class SpeedPlan:
    """What a request's ``speed`` and ``speed_mode`` ask of the engine and of the audio."""

    prompt: str | None
    """The ``[speed_N]`` prompt implied (None: leave the prompt as the request and defaults set it)."""
    stretch: float
    """The time-stretch factor of the audio (1: none; 2: half as long)."""
    model: float = 1.0
    """The speed asked of the model itself ("prompt" and "both"): a family with a speed of its own (Kokoro)
    takes it as an option, where ChatTTS takes ``prompt``."""


def plan_speed(speed: float, mode: str = "prompt") -> SpeedPlan:
    """``speed`` (1 = normal) as a prompt and a stretch factor; ValueError on a bad value."""
    if mode not in SPEED_MODES:
        raise ValueError(f"speed_mode must be one of {', '.join(SPEED_MODES)}, got {mode!r}")
    if not MIN_SPEED <= speed <= MAX_SPEED:
        raise ValueError(f"speed must be between {MIN_SPEED} and {MAX_SPEED}, got {speed}")
    if speed == 1.0:  # normal: leaves the defaults' prompt, no stretch
        return SpeedPlan(None, 1.0)
    prompt = speed_prompt(speed) if mode in ("prompt", "both") else None
    return SpeedPlan(prompt, speed if mode in ("stretch", "both") else 1.0, speed if prompt is not None else 1.0)


def atempo_chain(factor: float) -> list[float]:
    """``factor`` as atempo factors within ``_ATEMPO_RANGE`` whose product is ``factor``."""
    low, high = _ATEMPO_RANGE
    chain = []
    while factor > high:
        chain.append(high)
        factor /= high
    while factor < low:
        chain.append(low)
        factor /= low
    return [*chain, factor]


class StreamingStretcher:
    """float32 mono in, the same time-stretched by ``factor`` out (as long / ``factor``, same pitch); one per
    stream. The output's length is exactly ``round(samples in / factor)`` once flushed: atempo's last
    window would otherwise add a few ms past the end."""

    def __init__(self, factor: float, rate: int) -> None:
        import av

        if not MIN_SPEED <= factor <= MAX_SPEED:
            raise ValueError(f"stretch factor must be between {MIN_SPEED} and {MAX_SPEED}, got {factor}")
        self.factor, self.rate = factor, rate
        self._time_base = Fraction(1, rate)
        self._graph = av.filter.Graph()
        nodes = [self._graph.add_abuffer(format="flt", sample_rate=rate, layout="mono", time_base=self._time_base)]
        nodes += [self._graph.add("atempo", repr(f)) for f in atempo_chain(factor)]
        nodes.append(self._graph.add("abuffersink"))
        for a, b in pairwise(nodes):
            a.link_to(b)
        self._graph.configure()
        self.samples_in = 0
        self.samples_out = 0
        self._pts = 0  # samples pushed, the flush's padding included
        self._done = False

    def process(self, pcm: np.ndarray) -> np.ndarray:
        """The output ready after ``pcm`` (atempo holds about one window, ~40 ms, until more input or ``flush``)."""
        if self._done:
            raise RuntimeError("stretcher already flushed")
        if not len(pcm):
            return np.zeros(0, np.float32)
        self._push(pcm)
        self.samples_in += len(pcm)
        return self._pulled()

    def flush(self) -> np.ndarray:
        """The last samples of the stream. Nothing may follow."""
        if self._done:
            return np.zeros(0, np.float32)
        self._done = True
        if not self.samples_in:
            return np.zeros(0, np.float32)
        # atempo's output ends up to a window short of the input's stretched length when slowing down, and a
        # few ms past it when speeding up: pad with silence, then cut at exactly that length
        before, expected = self.samples_out, round(self.samples_in / self.factor)
        self._push(np.zeros(int(self.rate * 0.2 * max(1.0, self.factor)), np.float32))  # (a chain holds more)
        self._graph.push(None)
        tail = self._pulled()[: max(0, expected - before)]
        self.samples_out = before + len(tail)
        return tail

    def _push(self, pcm: np.ndarray) -> None:
        frame = mono_frame(pcm, self.rate)
        frame.time_base, frame.pts = self._time_base, self._pts
        self._pts += len(pcm)
        self._graph.push(frame)

    def _pulled(self) -> np.ndarray:
        import av

        parts = []
        while True:
            try:
                parts.append(self._graph.pull().to_ndarray().reshape(-1))
            except (av.error.BlockingIOError, av.error.EOFError):
                break
        out = np.concatenate(parts).astype(np.float32, copy=False) if parts else np.zeros(0, np.float32)
        self.samples_out += len(out)
        return out


def stretch(pcm: np.ndarray, factor: float, rate: int) -> np.ndarray:
    """All of ``pcm`` stretched by ``factor`` (the same samples a stream of its chunks gives)."""
    if factor == 1.0:
        return pcm
    stretcher = StreamingStretcher(factor, rate)
    return np.concatenate([stretcher.process(pcm), stretcher.flush()])
