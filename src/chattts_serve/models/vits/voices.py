"""A VITS checkpoint's voices: its speakers.

A single-speaker checkpoint (every MMS-TTS one) has one voice, ``default``. A multi-speaker one
(``num_speakers`` > 1 in config.json) has a voice per speaker id, ``speaker_0`` .. ``speaker_{N-1}``, and blends:
``speakers:0=0.25,2=0.75``, the weighted mean of those speakers' embeddings. The embedding is the only thing a
speaker changes (it conditions the duration predictor, the flow and the decoder through linear projections),
so a mean of embeddings is a point between the voices, as VITS users interpolate speakers; a single-speaker
checkpoint has nothing to mix, and says so. No voice (``speaker`` None) on a multi-speaker checkpoint speaks
as ``speaker_0``: every row of a batch is then conditioned (the padded decoder cannot mix conditioned and
unconditioned rows).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from ..family import Voices

DEFAULT = "default"
_SPEAKER = re.compile(r"speaker_(\d{1,6})")
_MIX = re.compile(r"speakers:(\d{1,6}=[0-9.e+-]+(?:,\d{1,6}=[0-9.e+-]+)*)")
MAX_BLEND = 8

Mix = tuple[tuple[int, float], ...]
"""Speaker ids and weights (> 0, summing to 1); one entry for a plain speaker."""


ISO639_1 = {
    "ara": "ar", "ben": "bn", "ces": "cs", "deu": "de", "ell": "el", "eng": "en", "fas": "fa", "fin": "fi",
    "fra": "fr", "guj": "gu", "hau": "ha", "heb": "he", "hin": "hi", "hun": "hu", "ind": "id", "ita": "it",
    "jav": "jv", "kan": "kn", "kor": "ko", "mal": "ml", "mar": "mr", "nld": "nl", "pol": "pl", "por": "pt",
    "ron": "ro", "rus": "ru", "spa": "es", "swe": "sv", "swh": "sw", "tam": "ta", "tel": "te", "tgl": "tl",
    "tha": "th", "tur": "tr", "ukr": "uk", "urd": "ur", "vie": "vi", "yor": "yo", "zlm": "ms",
}  # fmt: skip
"""MMS-TTS's ISO 639-3 codes (``tokenizer_config.json``'s ``language``) of widely spoken languages -> their
two-letter codes, which BCP 47 prefers and Home Assistant matches; any other code is listed as it is (a valid
BCP 47 tag for the many MMS languages that have no two-letter code)."""


def language_tag(code: str | None) -> str | None:
    """A checkpoint's language code as a BCP 47 tag (None: it names none)."""
    if not isinstance(code, str) or not re.fullmatch(r"[A-Za-z]{2,8}(?:[-_][A-Za-z0-9]{1,8})*", code):
        return None
    primary, *rest = code.replace("_", "-").split("-")
    return "-".join([ISO639_1.get(primary.lower(), primary.lower()), *rest])


class VitsVoices(Voices):
    def __init__(self, num_speakers: int, language: str | None = None) -> None:
        """``language``: the checkpoint's (``tokenizer_config.json``: ISO 639-3 for MMS-TTS), for listings."""
        self.num_speakers = num_speakers
        self.language = language_tag(language)

    @property
    def multi(self) -> bool:
        return self.num_speakers > 1

    @property
    def builtin(self) -> tuple[str, ...]:
        if not self.multi:
            return (DEFAULT,)
        return tuple(f"speaker_{i}" for i in range(self.num_speakers))

    def voice(self, name: str) -> str | None:
        return name

    def description(self, name: str) -> str:
        if not self.multi:
            return f"{name} (the checkpoint's one speaker)"
        return f"{name} (speaker id {name.removeprefix('speaker_')} of {self.num_speakers})"

    def languages(self, name: str) -> tuple[str, ...]:
        return () if self.language is None else (self.language,)

    def is_voice(self, text: str) -> bool:
        return text == DEFAULT or bool(_SPEAKER.fullmatch(text) or _MIX.fullmatch(text))

    def check(self, voice: str) -> None:
        self.mix(voice)

    def mix(self, voice: str | None) -> Mix | None:
        """``voice`` (a voice string; None: the checkpoint's default) as speaker ids and weights; None for a
        single-speaker checkpoint. Raises ValueError saying why a string is not a voice of this checkpoint."""
        shown = voice if voice is None or len(voice) <= 40 else voice[:40] + "..."
        if not self.multi:
            if voice not in (None, DEFAULT):
                raise ValueError(f"this VITS checkpoint has one speaker: its only voice is {DEFAULT!r}, got {shown!r}")
            return None
        if voice is None:
            return ((0, 1.0),)
        if (m := _SPEAKER.fullmatch(voice)) is not None:
            return ((self._speaker(int(m.group(1))), 1.0),)
        if _MIX.fullmatch(voice) is None:
            raise ValueError(
                f"a voice of this VITS checkpoint is speaker_0 .. speaker_{self.num_speakers - 1} or a blend of "
                f"them, got {shown!r}"
            )
        terms = [term.split("=") for term in voice.removeprefix("speakers:").split(",")]
        try:
            weights = [float(w) for _, w in terms]
        except ValueError:
            raise ValueError(f"a blend's weights must be numbers, got {shown!r}") from None
        return _normalised([self._speaker(int(i)) for i, _ in terms], weights)

    def blend(self, voices: Sequence[str], weights: Sequence[float]) -> str:
        if not self.multi:
            raise ValueError(f"this VITS checkpoint has one speaker ({DEFAULT!r}): there is nothing to blend")
        merged: dict[int, float] = {}
        for voice, weight in zip(voices, _normalised_weights(weights), strict=True):
            for speaker, share in self.mix(voice) or ():
                merged[speaker] = merged.get(speaker, 0.0) + weight * share
        if len(merged) > MAX_BLEND:
            raise ValueError(f"a blend mixes at most {MAX_BLEND} speakers, got {len(merged)}")
        if len(merged) == 1:
            return f"speaker_{next(iter(merged))}"
        return "speakers:" + ",".join(f"{s}={w:.6g}" for s, w in sorted(merged.items()))

    def _speaker(self, index: int) -> int:
        if not 0 <= index < self.num_speakers:
            raise ValueError(f"this VITS checkpoint has speakers 0 .. {self.num_speakers - 1}, got speaker {index}")
        return index


def _normalised_weights(weights: Sequence[float]) -> list[float]:
    values = [float(w) for w in weights]
    if not values or not all(math.isfinite(w) and w > 0 for w in values):
        raise ValueError(f"blend weights must be positive and finite, got {list(weights)}")
    total = sum(values)
    return [w / total for w in values]


def _normalised(speakers: list[int], weights: list[float]) -> Mix:
    if len(set(speakers)) != len(speakers):
        raise ValueError("a blend names a speaker twice")
    if len(speakers) > MAX_BLEND:
        raise ValueError(f"a blend mixes at most {MAX_BLEND} speakers, got {len(speakers)}")
    return tuple(zip(speakers, _normalised_weights(weights), strict=True))
