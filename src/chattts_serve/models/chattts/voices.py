"""ChatTTS's voices on the model-family seam: a voice is a speaker string (``models.chattts.speaker``: a float16
embedding, LZMA + base16384); a built-in name is a speaker sampled from a fixed seed; a blend mixes the
embeddings where speakers are sampled (``blend_speakers``)."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from ..family import Voices
from .speaker import SpeakerStats, blend_speakers, decode_speaker, encode_speaker

# OpenAI's voice names, so unmodified clients work (Pipecat refuses any other name): each is a fixed random
# speaker (seeded sample from the checkpoint's speaker statistics), unless a saved voice of that name exists.
# New names go at the end: a name's seed is its position, and a voice must not change under its users.
BUILTIN_VOICES = {
    name: 1000 + i
    for i, name in enumerate(
        (
            "alloy",
            "ash",
            "ballad",
            "coral",
            "echo",
            "fable",
            "nova",
            "onyx",
            "sage",
            "shimmer",
            "verse",
            "cedar",
            "marin",
        )
    )
}


def looks_like_speaker(text: str) -> bool:
    """Spelled as a speaker string (base16384 with its length marker), without decoding it."""
    return len(text) >= 16 and all(0x3D00 <= ord(c) <= 0x3D07 or 0x4E00 <= ord(c) <= 0x8DFF for c in text)


class ChatTTSVoices(Voices):
    def __init__(self, stats: SpeakerStats | None, hidden_size: int) -> None:
        self.stats, self.hidden_size = stats, hidden_size
        self._builtin: dict[str, str | None] = {}

    @property
    def builtin(self) -> tuple[str, ...]:
        return tuple(BUILTIN_VOICES)

    def voice(self, name: str) -> str | None:
        # Encoding a speaker string (LZMA at the reference's preset 9|extreme) takes ~50 ms: once per name.
        if name not in self._builtin:
            self._builtin[name] = self.sample(BUILTIN_VOICES[name]) if self.stats is not None else None
        return self._builtin[name]

    def sample(self, seed: int | None = None) -> str:
        """A random speaker string (the reference's ``sample_random_speaker``: the same seed on the CPU gives
        the same string)."""
        if self.stats is None:
            raise ValueError("this checkpoint has no speaker statistics; pass a speaker string instead")
        import torch

        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        return encode_speaker(self.stats.sample(gen))

    def description(self, name: str) -> str:
        return f"{name} (OpenAI voice name)"

    def languages(self, name: str) -> tuple[str, ...]:
        return ("zh", "en")  # every speaker speaks both: the text decides

    def is_voice(self, text: str) -> bool:
        return looks_like_speaker(text)

    def check(self, voice: str) -> None:
        decode_speaker(voice, expected_dim=self.hidden_size)

    def blend(self, voices: Sequence[str], weights: Sequence[float]) -> str:
        parts = [decode_speaker(v, expected_dim=self.hidden_size).tobytes() for v in voices]
        return _mixed_speaker(self.stats, *canonical_blend(parts, [float(w) for w in weights]))


BLEND_WEIGHT_DIGITS = 4
"""A blend's weights count to 1/10,000 of their sum: finer differences are far below what the float16
embedding can hold, and each distinct blend costs a mix."""


def canonical_blend(parts: list[bytes], weights: list[float]) -> tuple[tuple[bytes, ...], tuple[float, ...]]:
    """A blend as it is mixed, and its cache key: one term per distinct embedding (a voice named twice, or by
    name and by speaker string, adds its weights), in a fixed order, with the weights normalised to sum 1 and
    rounded to ``BLEND_WEIGHT_DIGITS`` (a term that rounds to 0 adds nothing and is left out). So blends that
    cannot sound different are one entry, and a request of many near-equal blends buys one mix, not many.
    ``weights``: positive and finite (``server.blend``)."""
    merged: dict[bytes, float] = {}
    top = max(weights)  # first to (0, 1]: the sum of a few huge weights cannot overflow
    for part, weight in zip(parts, weights, strict=True):
        merged[part] = merged.get(part, 0.0) + weight / top
    total = sum(merged.values())
    rounded = {p: round(w / total, BLEND_WEIGHT_DIGITS) for p, w in sorted(merged.items())}
    kept = {p: w for p, w in rounded.items() if w > 0}  # the largest is >= 1/8 (server.blend.MAX_BLEND_TERMS)
    return tuple(kept), tuple(kept.values())


@functools.lru_cache(maxsize=256)
def _mixed_speaker(stats, parts: tuple[bytes, ...], weights: tuple[float, ...]) -> str:
    """The speaker string of a blend (``canonical_blend``): ``parts`` are float16 embeddings' bytes (a cache
    key; ``stats`` is hashed by identity): the same blend again costs nothing."""
    embeddings = [np.frombuffer(p, dtype=np.float16) for p in parts]
    return encode_speaker(blend_speakers(embeddings, weights, stats))
