"""A request's text as VITS utterances: sentences, their input ids, and where each word lies among the ids.

VITS reads characters (``tokenizer``: one id per character of the prepared text, with blanks between), so a
word's place in the audio is exact: the word is a run of ids, and the duration predictor gives each id its
frames. ``Piece.words`` keeps, for each word, its text as the user wrote it and its run of ids.

Sentences end at ``.!?…`` (and their CJK forms) followed by a space, at a CJK full stop, and at a line break.
ChatTTS's splitter (``text.normalize.split_text``) copies the reference's quirks (it splits after ``.`` only,
and on newlines only when there is one) and is kept for ChatTTS. A sentence longer than ``max_ids`` ids is cut
at word boundaries, so every utterance fits the engine's work budget.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .tokenizer import VitsTokenizer

_SENTENCE_END = re.compile(r"(?<=[.!?…;。！？；])\s+|\n\s*|(?<=[。！？])")
_WORD = re.compile(r"\S+")


@dataclass(frozen=True, slots=True)
class Piece:
    """One utterance's text: what captions show, its ids and its words (text, first id, one past the last)."""

    text: str
    ids: tuple[int, ...]
    words: tuple[tuple[str, int, int], ...]


def sentences(text: str) -> list[str]:
    """``text``'s sentences, stripped, empty ones dropped."""
    return [s.strip() for s in _SENTENCE_END.split(text) if s and s.strip()]


def pieces(tokenizer: VitsTokenizer, text: str, max_ids: int, split: bool = True) -> list[Piece]:
    """``text`` as utterances of at most ``max_ids`` ids: its sentences (``split``; else the whole text, its
    whitespace runs one space), long ones cut at words. A sentence with nothing the vocabulary has (``"!!!"`` for
    MMS English, which has no punctuation) gives none."""
    out: list[Piece] = []
    for sentence in sentences(text) if split else [" ".join(text.split())]:
        for chunk in _fit(tokenizer, sentence, max_ids):
            piece = align(tokenizer, chunk)
            if piece.ids:
                out.append(piece)
    return out


def align(tokenizer: VitsTokenizer, text: str) -> Piece:
    """``text``'s ids and its words' runs of ids. A word of the prepared text (lower-cased, characters outside
    the vocabulary dropped) is shown as the user wrote it when the text's words map one to one (the usual case);
    otherwise (romanised or phonemised text) as the prepared word."""
    prepared, ids, chars = tokenizer.encode_aligned(text)
    spans = [m.span() for m in _WORD.finditer(prepared)]
    shown = _as_written(tokenizer, text, [prepared[a:b] for a, b in spans])
    words = []
    for (a, b), word in zip(spans, shown, strict=True):
        run = [i for i, c in enumerate(chars) if a <= c < b]
        words.append((word, run[0], run[-1] + 1))
    return Piece(text, tuple(ids), tuple(words))


def _as_written(tokenizer: VitsTokenizer, text: str, prepared: list[str]) -> list[str]:
    if tokenizer.phonemize:  # espeak per word would cost a process call each, and phonemes do not map back
        return prepared
    written = [w for w in text.split() if tokenizer.prepare(w)]
    if [tokenizer.prepare(w) for w in written] == prepared:
        return written
    return prepared


def _fit(tokenizer: VitsTokenizer, sentence: str, max_ids: int) -> list[str]:
    """``sentence`` in chunks whose ids fit ``max_ids``: cut before the word that would overflow (one word
    longer than that alone: cut inside it)."""
    if len(tokenizer.encode(sentence)) <= max_ids:
        return [sentence]
    chunks: list[str] = []
    current = ""
    for word in sentence.split():
        candidate = f"{current} {word}" if current else word
        if len(tokenizer.encode(candidate)) <= max_ids:
            current = candidate
            continue
        if current:
            chunks.append(current)
        while len(tokenizer.encode(word)) > max_ids:  # 2 ids a character with blanks: cut at the half
            cut = max(1, (max_ids - 1) // 2)
            chunks.append(word[:cut])
            word = word[cut:]
        current = word
    if current:
        chunks.append(current)
    return chunks
