"""A request's text as the utterances the engine batches: one per sentence, each within Kokoro's 510 phonemes.

``KPipeline`` speaks a line in chunks of up to 510 phonemes (``text.chunk_text``), several sentences each. We
cut a line into sentences first and speak each as its own utterance: the first sentence's audio can leave as
soon as it is done (streaming by sentence), and a long text becomes many rows that batch with other requests.
A sentence longer than 510 phonemes is then cut by the package's own waterfall (``text.chunking.split_tokens``).
This is the one deliberate difference from the package's chunking: a text of one sentence (of up to 510
phonemes) is the package's chunk, graphemes, phonemes and voice row alike; ``split_text=False`` speaks the
package's chunks exactly (``text.chunk_text``).

Sentences end after a token whose phonemes are only sentence marks (``.!?…``; the G2Ps keep each mark a token
of its own, and misaki's Chinese G2P has already mapped ``。！？`` to them), with any closing marks after it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence

from .text import MAX_PHONEMES, Chunk, Token
from .text.chunking import BUMPS, split_tokens
from .text.tokens import make_chunk

SENTENCE_MARKS = frozenset("!.?…")


def sentence_chunks(g2p, text: str) -> list[Chunk]:
    """``text``'s sentences as chunks in speaking order (``g2p``: a ``text.G2P``), each of at most 510 phonemes.
    Lines (``\\n``) are phonemized whole, as the package does, so a sentence keeps its line's context."""
    chunks: list[Chunk] = []
    for index, line in enumerate(re.split(r"\n+", text.strip())):
        if not line.strip():
            continue
        for sentence in split_sentences(g2p.tokens(line)):
            for tokens in split_tokens(sentence):
                chunk = make_chunk(tokens, None, index)
                if chunk.phonemes:
                    chunks.append(_fits(chunk))
    return chunks


def split_sentences(tokens: Sequence[Token]) -> Iterator[list[Token]]:
    """The tokens in sentences: each ends with its sentence marks and the closing marks after them."""
    current: list[Token] = []
    ended = False
    for token in tokens:
        if ended and not _closes(token):
            yield current
            current, ended = [], False
        current.append(token)
        ended = ended or _ends(token)
    if current:
        yield current


def _ends(token: Token) -> bool:
    return bool(token.phonemes) and set(token.phonemes) <= SENTENCE_MARKS


def _closes(token: Token) -> bool:
    """A token that still belongs to the sentence just ended: another mark, a closing bracket or quote, or a
    token without phonemes."""
    return not token.phonemes or token.phonemes in BUMPS or _ends(token)


def _fits(chunk: Chunk) -> Chunk:
    if len(chunk.phonemes) > MAX_PHONEMES:  # only one word alone can do this (the waterfall cuts between words)
        word = max(chunk.tokens, key=lambda t: len(t.phonemes))
        raise ValueError(
            f"text: the word {word.text[:40]!r} alone has {len(word.phonemes)} phonemes, more than Kokoro's "
            f"context of {MAX_PHONEMES}"
        )
    return chunk
