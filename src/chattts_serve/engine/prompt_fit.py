"""Fitting an audio pass into a KV slot: its prompt plus its ``max_new_tokens`` must fit ``max_model_len``.

A code pass's prompt is its template, the voice sample's transcript, the sentence's (refined) text and
the voice sample's codes. The refine pass and the first sentence's voice sample make it longer than the
text the client sent, so a sentence that fits as written may not fit as spoken. Such a pass is split into
*parts*, spoken one after the other into the sentence's audio, in this order of preference:

1. one pass, as the reference speaks it (every sentence that fits: nothing changes);
2. one pass with ``max_new_tokens`` (a cap: speech mostly ends long before it) shortened to what the
   slot holds, when that keeps ``min_new_tokens`` and at least half the cap (a long voice sample);
3. parts cut after sentence and break marks (``。``, ``,``, ``[uv_break]``, ``[lbreak]``, ...), the
   fewest that fit (a long refined text);
4. as 2, keeping only ``min_new_tokens`` (the sentence has no marks to cut at);
5. parts cut anywhere (at spaces, else between characters), the fewest that fit (at most ``MAX_PARTS``).

Parts share the pass's ``min_new_tokens`` and ``max_new_tokens`` (split as evenly as integers allow), so a
split sentence asks for the same audio in all as the pass it replaces: the request's audio budget holds.
Pure functions over a token counter; no torch.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

_MARK_END = re.compile(r"(?<=[。！？!?；;，,、：:…])|(?<=\.\s)|(?<=\])")
"""Cut points after a sentence or clause mark, or after a control token (``[uv_break]``, ``[lbreak]``)."""
_SPACE_END = re.compile(r"(?<=\s)(?=\S)")
MAX_PARTS = 16
"""Most parts one pass is cut into: beyond it the parts would be a few tokens of audio each (and the
search would cost more than the pass is worth); such a pass does not fit."""


@dataclass(frozen=True, slots=True)
class Part:
    text: str
    min_new_tokens: int
    max_new_tokens: int


def fit(
    text: str, prompt_len: Callable[[str], int], min_new: int, max_new: int, max_model_len: int
) -> list[Part] | None:
    """The passes that speak ``text`` (see the module's order), or None when none fits.

    ``prompt_len(t)``: the whole prompt's positions (template, sample, codes) for a pass speaking ``t``."""
    whole = prompt_len(text)
    if whole + max_new <= max_model_len:
        return [Part(text, min_new, max_new)]
    room = max_model_len - whole
    if room >= max(1, min_new, max_new // 2):
        return [Part(text, min_new, room)]
    fixed = prompt_len("")
    marked = _split(text, _MARK_END)
    parts = _fewest_parts(marked, prompt_len, fixed, min_new, max_new, max_model_len, fine=False)
    if parts is None and room >= max(1, min_new):
        return [Part(text, min_new, room)]
    words = [w for piece in marked for w in _split(piece, _SPACE_END)]
    return parts or _fewest_parts(words, prompt_len, fixed, min_new, max_new, max_model_len, fine=True)


def shares(total: int, k: int) -> list[int]:
    """``total`` in ``k`` integers as even as possible, the larger first."""
    q, r = divmod(total, k)
    return [q + (i < r) for i in range(k)]


def _split(text: str, boundary: re.Pattern) -> list[str]:
    return [p for p in boundary.split(text) if p]


def _fewest_parts(
    pieces: list[str],
    prompt_len: Callable[[str], int],
    fixed: int,
    min_new: int,
    max_new: int,
    max_model_len: int,
    fine: bool,
) -> list[Part] | None:
    """The fewest parts (k >= 2) of whole ``pieces`` (``fine``: pieces cut between characters as needed) that fit with
    ``max_new`` split k ways. Feasibility only grows with k (each part's cap shrinks), so the search halves."""
    counts = [max(1, prompt_len(p) - fixed) for p in pieces]
    lo, hi, best = 2, min(MAX_PARTS, max_new, sum(counts) if fine else len(pieces)), None
    while lo <= hi:
        k = (lo + hi) // 2
        parts = _pack(pieces, counts, prompt_len, fixed, max_model_len - -(-max_new // k), k, fine)
        if parts is not None and _fits(parts, prompt_len, shares(max_new, k), max_model_len):
            best, hi = (parts, k), k - 1
        else:
            lo = k + 1
    if best is None:
        return None
    texts, k = best
    return [Part(t, lo_, hi_) for t, lo_, hi_ in zip(texts, shares(min_new, k), shares(max_new, k), strict=True)]


def _pack(
    pieces: list[str],
    counts: list[int],
    prompt_len: Callable[[str], int],
    fixed: int,
    room: int,
    k: int,
    fine: bool,
) -> list[str] | None:
    """Consecutive pieces packed greedily into exactly ``k`` parts of at most ``room`` prompt positions
    (None: more than ``k`` needed, or a piece alone is too long)."""
    room -= fixed
    if room < 1:
        return None
    groups: list[list[str]] = []
    size = room + 1
    for piece, n in zip(pieces, counts, strict=True):
        if n > room:
            if not fine:
                return None
            sub = _runs(list(piece), prompt_len, fixed, room)
            if sub is None:
                return None
            groups += [[s] for s in sub]
            size = room + 1
            continue
        if size + n > room:
            groups.append([])
            size = 0
        groups[-1].append(piece)
        size += n
    if len(groups) > k:
        return None
    while len(groups) < k:  # fewer parts than k: cut the largest group (caps were sized for k parts)
        i = max(range(len(groups)), key=lambda j: len(groups[j]))
        g = groups[i]
        if len(g) < 2 and fine:
            g = list(g[0])
        if len(g) < 2:
            return None
        groups[i : i + 1] = [g[: len(g) // 2], g[len(g) // 2 :]]
    return ["".join(g) for g in groups]


def _runs(chars: list[str], prompt_len: Callable[[str], int], fixed: int, room: int) -> list[str] | None:
    """Consecutive characters in runs of at most ``room`` text positions (counted character by character;
    ``_fits`` checks the real prompts)."""
    runs: list[str] = []
    size = room + 1
    for c in chars:
        n = prompt_len(c) - fixed
        if n > room:
            return None
        if size + n > room:
            runs.append("")
            size = 0
        runs[-1] += c
        size += n
    return runs


def _fits(texts: list[str], prompt_len: Callable[[str], int], caps: list[int], max_model_len: int) -> bool:
    """Each part's real prompt (token counts need not add up across a cut) and its cap fit."""
    return all(prompt_len(t) + cap <= max_model_len for t, cap in zip(texts, caps, strict=True))
