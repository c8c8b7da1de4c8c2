"""Text that arrives in pieces (an LLM writing it) as parts to speak, and the voice kept from the first part.

Shared by the WebSocket session (``server.websocket``) and the Wyoming server (``server.wyoming``): both speak
each sentence as soon as it is complete, and both give every later part the first part's voice (the engine's
first-sentence voice step, for text that arrives in pieces).
"""

from __future__ import annotations

import bisect
import re
from dataclasses import replace

import numpy as np

from ..model.speaker import MIN_VOICE_SAMPLES

SENTENCE_END = re.compile(r"[。！？!?.\n]")
_SOFT_BREAK = re.compile(r"[\s,，、;；:：]")


class Segmenter:
    """Cuts the incoming text into parts to speak (see ``_cut``). Only new text is scanned for sentence ends,
    and what is kept between messages (``pending``, no sentence end in it) is at most ``limit`` characters, so
    the work per message is O(len(new) + limit): linear in the session's text."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.pending = ""

    def feed(self, new: str) -> list[str]:
        ends = [len(self.pending) + m.end() for m in SENTENCE_END.finditer(new)]
        parts, self.pending = _cut(self.pending + new, ends, self.limit)
        return parts

    def flush(self) -> list[str]:
        rest, self.pending = self.pending, ""
        return [rest] if rest else []


def _cut(text: str, ends: list[int], limit: int) -> tuple[list[str], str]:
    """``text`` as (parts to speak now, the rest to keep). Parts have at most ``limit`` characters and end at
    the last sentence end that fits; a longer sentence is cut at a soft break. The rest (no sentence end in
    it) is kept while it is at most ``limit`` characters. ``ends``: offsets just after each sentence end."""
    parts, start = [], 0
    last = ends[-1] if ends else 0
    while start < last or len(text) - start > limit:
        i = bisect.bisect_right(ends, start + limit) - 1
        stop = ends[i] if i >= 0 and ends[i] > start else _soft_break(text, start, limit)
        parts.append(text[start:stop])
        start = stop
    return parts, text[start:]


def _soft_break(text: str, start: int, limit: int) -> int:
    """Where to cut a sentence longer than ``limit``: after the last space or comma in the second half of the
    window (so every piece has at least limit/2 characters and the search stays linear), else at the limit."""
    best = None
    for m in _SOFT_BREAK.finditer(text, start + limit // 2, start + limit):
        best = m.end()
    return best or start + limit


def voice_from_first_part(params) -> bool:
    return params.split_text and params.first_sentence_voice and params.speaker_sample is None


async def with_first_part_voice(st, params, final, audio: list[np.ndarray]):
    """The session's voice, kept from its first part on: every later part is spoken with a voice sample
    of the first part's audio and its text as transcript (the engine's voice step, for text that
    arrives in pieces; the first part itself has already been heard as it was)."""
    if not final.segments:
        return params
    sample = final.voice_sample
    if sample is None:
        wav = np.concatenate(audio) if audio else np.zeros(0, np.float32)
        if len(wav) < MIN_VOICE_SAMPLES:
            return params
        sample = await st.engine.speaker_from_audio(wav)
    return replace(params, speaker_sample=sample, speaker_sample_text=final.segments[0].text)


def speakable(text: str) -> bool:
    return any(ch.isalnum() for ch in text)
