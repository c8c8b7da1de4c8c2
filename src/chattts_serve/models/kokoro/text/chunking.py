"""Long text to chunks of at most 510 phonemes, split where ``KPipeline.__call__`` splits it.

Both languages first split the text at newlines (``split_pattern=r"\\n+"``). English then runs
``KPipeline.en_tokenize`` over the G2P's tokens: a chunk grows token by token and, when the next
token would pass 510, is cut after the last sentence mark (``!.?…``), else the last ``:;``, else the
last ``,—`` whose cut leaves the rest within 510, else before the token (``waterfall_last``).
Chinese groups the line's sentences (split at ASCII ``.!?`` in the graphemes) into chunks of at most
400 characters, then phonemizes each chunk whole; the package truncates a chunk whose phonemes pass
510 (a 150-character Chinese sentence does), which drops speech: here such a chunk is cut by the
English waterfall over its words instead, so no text is lost. Every chunk the package does not
truncate is the package's chunk, graphemes and phonemes alike.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence

from chattts_serve.models.kokoro.text.tokens import MAX_PHONEMES, Chunk, Token, join_phonemes, make_chunk
from chattts_serve.models.kokoro.text.vocab import check_phonemes

WATERFALL = ("!.?…", ":;", ",—")
BUMPS = (")", "”")
ZH_CHUNK_CHARS = 400  # KPipeline's chunk_size for languages other than English


def waterfall_last(tokens: Sequence[Token], next_count: int) -> int:
    """``KPipeline.waterfall_last``: where to cut ``tokens`` so the rest and the next token fit."""
    for marks in WATERFALL:
        z = next((i for i in reversed(range(len(tokens))) if tokens[i].phonemes in set(marks)), None)
        if z is None:
            continue
        z += 1
        if z < len(tokens) and tokens[z].phonemes in BUMPS:
            z += 1
        if next_count - len(join_phonemes(tokens[:z])[0]) <= MAX_PHONEMES:
            return z
    return len(tokens)


def split_tokens(tokens: Sequence[Token]) -> Iterator[list[Token]]:
    """``KPipeline.en_tokenize``: the token groups, each joining to at most 510 phonemes."""
    tks: list[Token] = []
    pcount = 0
    for t in tokens:
        next_ps = t.phonemes + t.space
        next_pcount = pcount + len(next_ps.rstrip())
        if next_pcount > MAX_PHONEMES:
            z = waterfall_last(tks, next_pcount)
            if z:
                yield tks[:z]
            tks = tks[z:]
            pcount = len(join_phonemes(tks)[0])
            if not tks:
                next_ps = next_ps.lstrip()
        tks.append(t)
        pcount += len(next_ps)
    if tks:
        yield tks


def zh_groups(line: str) -> list[str]:
    """``KPipeline.__call__``'s non-English grouping: sentences (ASCII ``.!?``) into <= 400 characters."""
    parts = re.split(r"([.!?]+)", line)
    chunks, current = [], ""
    for i in range(0, len(parts), 2):
        sentence = parts[i] + (parts[i + 1] if i + 1 < len(parts) else "")
        if len(current) + len(sentence) <= ZH_CHUNK_CHARS:
            current += sentence
        else:
            if current:
                chunks.append(current.strip())
            current = sentence
    if current:
        chunks.append(current.strip())
    return [c for c in chunks if c.strip()]


def _checked(chunk: Chunk) -> Chunk:
    if len(chunk.phonemes) > MAX_PHONEMES:  # only one word alone can do this
        word = max(chunk.tokens, key=lambda t: len(t.phonemes))
        raise ValueError(f"text: the word {word.text[:40]!r} alone has {len(word.phonemes)} phonemes, "
                         f"more than Kokoro's context of {MAX_PHONEMES}")
    return chunk


def chunk_text(g2p, text: str) -> list[Chunk]:
    """``text`` as the model calls it: chunks of at most 510 phonemes, with their words.

    ``g2p`` is a ``G2P`` (its ``lang`` picks the package's English or Chinese splitting). Chunks
    without phonemes are left out, as the package leaves them out.
    """
    chunks: list[Chunk] = []
    for index, line in enumerate(re.split(r"\n+", text.strip())):
        if not line.strip():
            continue
        if g2p.lang in ("a", "b"):
            groups = [(None, tks) for tks in split_tokens(g2p.tokens(line))]
        else:
            groups = []
            for graphemes in zh_groups(line):
                tokens = g2p.tokens(graphemes)
                if len(join_phonemes(tokens)[0]) <= MAX_PHONEMES:
                    groups.append((graphemes, tokens))
                else:
                    groups.extend((None, tks) for tks in split_tokens(tokens))
        for graphemes, tks in groups:
            chunk = make_chunk(tks, graphemes, index)
            if chunk.phonemes:
                chunks.append(_checked(chunk))
    return chunks


def chunk_phonemes(phonemes: str, vocab) -> Chunk:
    """A caller's ``phonemes`` as one chunk, unchanged (``KPipeline.generate_from_tokens`` with a string):
    every symbol must be in ``vocab`` and there may be at most 510. Its words are the space-separated
    phoneme groups, so word times still come out."""
    check_phonemes(phonemes, vocab)
    tokens, spans = [], []
    for m in re.finditer(r"(\S+)(\s*)", phonemes):
        tokens.append(Token(m.group(1), m.group(1), m.group(2), m.group(2)))
        spans.append(m.span(1))
    return Chunk("", phonemes, tuple(tokens), tuple(spans))
