"""Voice blends in Kokoro-FastAPI's syntax: ``"a(2)+b(1)"``, terms joined by ``+``, each a voice (a saved
voice's name, a built-in voice name or a speaker string) with an optional positive weight in parentheses
(default 1). This module only parses; ``params.resolve_voice`` resolves the terms and
``models.chattts.speaker.blend_speakers`` mixes them.

Splitting on ``+`` is safe: no voice can contain ``+``, ``(`` or ``)``. Saved names are ASCII letters,
digits, ``-``, ``_`` and ``.`` (``protocol.VoiceCreate``), built-in names are letters, and speaker strings
are base16384 text (U+4E00..U+8DFF, with U+3D00..U+3D07 as the length marker). Weights are plain decimals
(``2``, ``0.5``, ``.5``): no sign, no exponent (whose ``+`` would need its own rule), no ``nan``/``inf``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

MAX_BLEND_TERMS = 8
"""The most voices one blend mixes: enough for any mix a person means, and a bound on the work a request
asks for (each term may be a speaker string to decompress)."""

_TERM = re.compile(r"\s*([^\s()+]+)\s*(?:\(([^()]*)\))?\s*")
_WEIGHT = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*")


@dataclass(frozen=True, slots=True)
class BlendTerm:
    voice: str
    weight: float = 1.0


class BlendError(ValueError):
    """A malformed blend; the message names the offending term."""


def is_blend(text: str) -> bool:
    """Whether a voice field holds a blend (or tries to) rather than one voice."""
    return any(c in text for c in "+()")


def parse_blend(text: str) -> list[BlendTerm]:
    """``"a(2)+b(1)"`` -> ``[BlendTerm("a", 2.0), BlendTerm("b", 1.0)]``. Raises ``BlendError`` for an empty
    term, a malformed term, a weight that is not a positive finite decimal, or more than ``MAX_BLEND_TERMS``
    terms. The weights are as written (``models.chattts.speaker.blend_speakers`` normalises them)."""
    parts = text.split("+")
    if len(parts) > MAX_BLEND_TERMS:
        raise BlendError(f"a blend mixes at most {MAX_BLEND_TERMS} voices, this one has {len(parts)}")
    return [_term(part, i) for i, part in enumerate(parts, 1)]


def _term(part: str, index: int) -> BlendTerm:
    if not part.strip():
        raise BlendError(f"blend term {index} is empty")
    m = _TERM.fullmatch(part)
    if m is None:
        raise BlendError(f"blend term {index} {shown_term(part)} is not a voice with an optional (weight)")
    voice, weight = m.group(1), m.group(2)
    if weight is None:
        return BlendTerm(voice)
    w = _WEIGHT.fullmatch(weight)
    value = float(w.group(1)) if w else math.nan
    if not (w and math.isfinite(value) and value > 0):
        raise BlendError(f"blend term {index} {shown_term(part)}: the weight must be a positive number like 2 or 0.5")
    return BlendTerm(voice, value)


def shown_term(part: str, limit: int = 64) -> str:
    """A term as an error message quotes it: speaker strings are hundreds of characters long."""
    part = part.strip()
    return repr(part if len(part) <= limit else part[:limit] + "...")
