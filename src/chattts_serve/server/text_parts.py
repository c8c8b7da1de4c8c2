"""Text that arrives in pieces (an LLM writing it) as parts to speak: each sentence as soon as it is complete.

Used by the streaming-text session (``server.text_session``) that the WebSocket and Wyoming servers share.
"""

from __future__ import annotations

import bisect
import re

SENTENCE_END = re.compile(r"[。！？!?.\n]")
_ASCII_END = frozenset(".!?")
_SOFT_BREAK = re.compile(r"[\s,，、;；:：]")


def _ends(text: str, start: int) -> list[int]:
    """Offsets just after each sentence end in ``text[start:]``. ``。！？`` and a line break always end a
    sentence; an ASCII ``.``, ``!`` or ``?`` only when what follows is no ASCII letter or digit (not in
    ``23.5``, ``dapr.io``, ``e.g``) and no other of the three (``...`` ends once, after its last dot), so
    one at the very end of the text is undecided until more arrives."""
    out = []
    for m in SENTENCE_END.finditer(text, start):
        end = m.end()
        if m.group() in _ASCII_END:
            if end == len(text) or text[end] in _ASCII_END or (text[end].isascii() and text[end].isalnum()):
                continue  # undecided yet, inside a run such as "..." or "?!", or inside a number or a name
        out.append(end)
    return out


class Segmenter:
    """Cuts the incoming text into parts to speak (see ``_cut``). Text arrives in chunks cut anywhere, even
    inside a word or a number (an LLM's tokens; Home Assistant forwards them as they come): only the new
    text and the last character kept from before (an ASCII full stop that ended the previous chunk) are
    scanned for sentence ends, and what is kept between messages (``pending``, no sentence end in it) is at
    most ``limit`` characters, so the work per message is O(len(new) + limit): linear in the session's text."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.pending = ""

    def feed(self, new: str) -> list[str]:
        text = self.pending + new
        parts, self.pending = _cut(text, _ends(text, max(0, len(self.pending) - 1)), self.limit)
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


def speakable(text: str) -> bool:
    return any(ch.isalnum() for ch in text)
