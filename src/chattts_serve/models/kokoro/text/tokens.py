"""The unit the text front-end works in: a word (or a punctuation mark) with its phonemes."""

from __future__ import annotations

from dataclasses import dataclass

MAX_PHONEMES = 510
"""Kokoro's context is 512 positions (ALBERT's ``max_position_embeddings``): 510 phonemes and the two
``0`` boundary ids. ``KPipeline`` chunks to this many phoneme characters."""


@dataclass(frozen=True)
class Token:
    """One word or punctuation mark.

    ``space`` is what follows the token in the phoneme string (English: ``" "`` or ``""``, as
    ``KPipeline.tokens_to_ps`` joins misaki's tokens; Chinese: the text between words verbatim, as
    misaki's zh G2P joins them). ``text_space`` is what follows it in the graphemes.
    """

    text: str
    phonemes: str
    space: str = ""
    text_space: str = ""


@dataclass(frozen=True)
class Chunk:
    """One model call's worth of text: ``phonemes`` has at most ``MAX_PHONEMES`` characters.

    ``spans[k]`` is ``tokens[k]``'s ``[start, end)`` in ``phonemes``; a token whose phonemes were
    stripped off the chunk's edges has an empty span. ``text_index`` is the line (``\\n``-separated
    part) of the input the chunk came from, as ``KPipeline.Result.text_index``. The voice pack's row
    for the chunk is ``len(phonemes) - 1`` (the package counts symbols the vocab lacks there too).
    """

    text: str
    phonemes: str
    tokens: tuple[Token, ...]
    spans: tuple[tuple[int, int], ...]
    text_index: int = 0


def join_phonemes(tokens: list[Token] | tuple[Token, ...]) -> tuple[str, tuple[tuple[int, int], ...]]:
    """The chunk's phoneme string (``KPipeline.tokens_to_ps``: joined, then stripped) and each token's span."""
    raw = "".join(t.phonemes + t.space for t in tokens)
    lead = len(raw) - len(raw.lstrip())
    ps = raw.strip()
    spans, pos = [], -lead
    for t in tokens:
        start, end = max(pos, 0), min(max(pos + len(t.phonemes), 0), len(ps))
        spans.append((min(start, end), end))
        pos += len(t.phonemes) + len(t.space)
    return ps, tuple(spans)


def join_text(tokens: list[Token] | tuple[Token, ...]) -> str:
    """The chunk's graphemes (``KPipeline.tokens_to_text``)."""
    return "".join(t.text + t.text_space for t in tokens).strip()


def make_chunk(tokens: list[Token] | tuple[Token, ...], text: str | None = None, text_index: int = 0) -> Chunk:
    ps, spans = join_phonemes(tokens)
    return Chunk(join_text(tokens) if text is None else text, ps, tuple(tokens), spans, text_index)
