"""A test-only "batch" model family: the model-family seam exercised without Kokoro.

Its "model" turns each word of a sentence into one id, gives each id a duration (frames of 10 ms, longer for
longer words, shorter at a higher ``speed``) and sounds it as a sine at the voice's pitch, moved by the id: a
deterministic model with Kokoro's shape (whole utterances, ids in, audio and per-id durations out, word
timestamps counted from the durations) at its own sample rate (16 kHz). Voices are pitches: built-in
``low`` and ``high``, voice strings ``hz:<pitch>``, blends the weighted mean of pitches. Its one option,
``speed``, travels in ``SamplingParams.options``.

``SineFamily`` is registered by the tests that use it (``registered``); ``SineModel.batches`` records the
size of every batch it ran, and ``gate`` (a Semaphore) holds each ``synthesize`` until a permit is released.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from chattts_serve import models
from chattts_serve.models.family import BatchModel, Capabilities, ModelFamily, Speech, Utterance, Voices, Word

RATE = 16000
FRAME = 160  # samples per duration frame: 10 ms at 16 kHz
CONFIG = "sine.json"
PITCHES = {"low": 220.0, "high": 440.0}
_SENTENCE = re.compile(r"[^.!?。！？]+[.!?。！？]*")


class SineVoices(Voices):
    @property
    def builtin(self) -> tuple[str, ...]:
        return tuple(PITCHES)

    def voice(self, name: str) -> str | None:
        return f"hz:{PITCHES[name]:g}"

    def is_voice(self, text: str) -> bool:
        return text.startswith("hz:")

    def check(self, voice: str) -> None:
        pitch(voice)

    def blend(self, voices: Sequence[str], weights: Sequence[float]) -> str:
        w = np.asarray(weights, dtype=np.float64)
        if not (np.isfinite(w).all() and (w > 0).all()):
            raise ValueError("blend weights must be positive and finite")
        return f"hz:{float(np.dot(w / w.sum(), [pitch(v) for v in voices])):g}"


def pitch(voice: str) -> float:
    try:
        hz = float(voice.removeprefix("hz:")) if voice.startswith("hz:") else float("nan")
    except ValueError:
        hz = float("nan")
    if not 50 <= hz <= 2000:
        raise ValueError(f"a sine voice is 'hz:<pitch>' with a pitch of 50-2000 Hz, got {voice[:40]!r}")
    return hz


@dataclass(frozen=True, slots=True)
class SineOptions:
    speed: float = 1.0
    hz: float = PITCHES["low"]


@dataclass(frozen=True, slots=True)
class SineInputs:
    ids: tuple[int, ...]
    words: tuple[str, ...]
    options: SineOptions


class SineModel(BatchModel):
    def __init__(self, family: SineFamily, root: Path, config) -> None:
        self.family, self.root, self.config = family, root, config
        self.settings = json.loads((root / CONFIG).read_text())
        self._voices = SineVoices()
        self.batches: list[int] = []
        self.gate: threading.Semaphore | None = None

    @property
    def sample_rate(self) -> int:
        return self.settings["sample_rate"]

    @property
    def voices(self) -> SineVoices:
        return self._voices

    def identity(self) -> list[str]:
        return [str(self.root.resolve()), (self.root / CONFIG).read_text()]

    def check_options(self, params) -> SineOptions:
        models.check_foreign(params, self.family.name)
        options = dict(params.options or {})
        unknown = set(options) - {"speed"}
        if unknown:
            raise ValueError(f"unknown sine option(s): {', '.join(sorted(unknown))}; it takes speed")
        speed = options.get("speed", 1.0)
        if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not 0.25 <= speed <= 4:
            raise ValueError(f"speed must be a number in 0.25..4, got {speed!r}")
        hz = pitch(params.speaker) if params.speaker is not None else PITCHES["low"]
        return SineOptions(float(speed), hz)

    def utterances(self, text: str, params) -> list[Utterance]:
        options = self.check_options(params)
        if not isinstance(text, str) or not text.strip():
            raise ValueError("text is empty")
        out = []
        for sentence in (s.strip() for s in _SENTENCE.findall(text) if s.strip()):
            words = tuple(sentence.split())
            ids = tuple(sum(map(ord, w)) % 97 + 1 for w in words)
            out.append(Utterance(sentence, len(ids), SineInputs(ids, words, options)))
        return out

    def synthesize(self, batch: Sequence[Utterance]) -> list[Speech]:
        if self.gate is not None:
            assert self.gate.acquire(timeout=30), "the test never let this batch run"
        self.batches.append(len(batch))
        return [self._one(u.inputs) for u in batch]

    def _one(self, inputs: SineInputs) -> Speech:
        frames = [max(1, round((2 + len(w)) / inputs.options.speed)) for w in inputs.words]
        parts, words, at = [], [], 0
        for word, i, n in zip(inputs.words, inputs.ids, frames, strict=True):
            t = np.arange(n * FRAME) / self.sample_rate
            parts.append((0.3 * np.sin(2 * np.pi * inputs.options.hz * (1 + i / 100) * t)).astype(np.float32))
            words.append(Word(word, at, at + n * FRAME))
            at += n * FRAME
        return Speech(np.concatenate(parts), tuple(words))


class SineFamily(ModelFamily):
    name = "sine"
    execution = "batch"
    capabilities = Capabilities(streaming="sentence", timestamps="word", refine=False, control_tokens=False)
    hub_repos = ("tests/sine",)

    def is_checkpoint(self, root: Path) -> bool:
        return (root / CONFIG).is_file()

    def resolve(self, path_or_repo) -> Path:
        root = Path(path_or_repo)
        if not self.is_checkpoint(root):
            raise ValueError(f"no sine checkpoint in {str(root)!r} (it needs {CONFIG})")
        return root

    def write_random(self, directory, size="tiny", seed: int = 0) -> Path:
        root = Path(directory)
        root.mkdir(parents=True, exist_ok=True)
        (root / CONFIG).write_text(json.dumps({"sample_rate": RATE, "size": size, "seed": seed}) + "\n")
        return root

    def load(self, root: Path, device, config) -> SineModel:
        return SineModel(self, root, config)


@contextmanager
def registered() -> Iterator[SineFamily]:
    """The sine family in the registry while the block runs."""
    family = models.register(SineFamily())
    try:
        yield family
    finally:
        models.unregister(family.name)
