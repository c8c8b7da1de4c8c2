"""Chunks of at most 510 phonemes, cut where KPipeline cuts."""

from __future__ import annotations

import pytest

from chattts_serve.models.kokoro.text import MAX_PHONEMES, Token, chunk_text
from chattts_serve.models.kokoro.text.chunking import split_tokens, zh_groups
from chattts_serve.models.kokoro.text.tokens import join_phonemes, make_chunk

from .golden import golden

EN_TOKENIZE = golden()["en_tokenize"]


@pytest.mark.parametrize("case", EN_TOKENIZE, ids=[c["text"][:16] for c in EN_TOKENIZE])
def test_english_chunks_are_en_tokenizes(case):
    tokens = [Token(t, p, " " if w else "", w) for t, p, w in case["tokens"]]
    groups = list(split_tokens(tokens))
    chunks = [make_chunk(g) for g in groups]
    assert [[c.text, c.phonemes, len(c.tokens)] for c in chunks] == case["chunks"]


def test_long_english_is_cut_after_the_last_sentence():
    assert any(len(c["chunks"]) > 1 for c in EN_TOKENIZE)  # the goldens do exercise the cut
    case = next(c for c in EN_TOKENIZE if len(c["chunks"]) > 1 and "fox" in c["text"])
    assert all(ps.endswith(".") and len(ps) <= MAX_PHONEMES for _, ps, _ in case["chunks"][:-1])


class _FakeG2P:
    def __init__(self, lang, tokens):
        self.lang, self._tokens = lang, tokens

    def tokens(self, text):
        return list(self._tokens)


def _word(n: int, mark: str = "") -> list[Token]:
    space = "" if mark else " "
    return [Token("w", "a" * n, space, space)] + ([Token(mark, mark, " ", " ")] if mark else [])


def test_waterfall_prefers_a_sentence_mark_then_a_clause_mark():
    tokens = _word(100, ",") + _word(100, ".") + _word(100, ",") + _word(150) + _word(100)
    chunks = chunk_text(_FakeG2P("a", tokens), "x")
    assert [c.phonemes[-1] for c in chunks] == [".", "a"]  # cut after the ".", not the later ","
    assert "".join(c.phonemes for c in chunks).replace(" ", "") == join_phonemes(tokens)[0].replace(" ", "")


def test_a_closing_bracket_stays_with_its_sentence():
    tokens = _word(200) + [Token("w", "a" * 200), Token(".", "."), Token(")", ")", " ", " ")] + _word(200)
    first = chunk_text(_FakeG2P("a", tokens), "x")[0]
    assert first.phonemes.endswith(".)")


def test_a_word_longer_than_the_context_is_a_clear_error():
    with pytest.raises(ValueError, match="alone has 600 phonemes"):
        chunk_text(_FakeG2P("a", _word(600)), "x")


def test_lines_are_split_first_and_numbered():
    chunks = chunk_text(_FakeG2P("a", _word(3)), "one\n\n  \ntwo")
    assert [c.text_index for c in chunks] == [0, 2]


def test_zh_groups_sentences_into_400_characters():
    s = "句" * 150 + "."
    assert zh_groups(s * 3) == [s * 2, s]
    assert zh_groups("没有句号" * 150) == ["没有句号" * 150]  # one group, however long (as the package)


def test_spans_survive_stripping():
    chunk = make_chunk([Token("x", "", " ", " "), Token("a", "ab", " ", " "), Token("b", "c", " ", " ")])
    assert chunk.phonemes == "ab c"
    assert [chunk.phonemes[s:e] for s, e in chunk.spans] == ["", "ab", "c"]
