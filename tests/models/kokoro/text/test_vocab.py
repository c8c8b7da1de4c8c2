from __future__ import annotations

import pytest

from chattts_serve.models.kokoro.text import MAX_PHONEMES, check_phonemes, chunk_phonemes, phonemes_to_ids

from .golden import vocab


def test_ids_have_the_zero_boundaries_and_drop_unknown_symbols():
    v = vocab()
    # KModel.forward: unknown symbols (here "g" and an emoji) are dropped, the rest wrapped in [0, ..., 0]
    assert phonemes_to_ids("həlˈO g😀,", v) == [0, 50, 83, 54, 156, 31, 16, 3, 0]


def test_ids_past_the_context_are_refused():
    assert len(phonemes_to_ids("a" * MAX_PHONEMES, vocab())) == MAX_PHONEMES + 2
    with pytest.raises(ValueError, match="511 phonemes exceed"):
        phonemes_to_ids("a" * (MAX_PHONEMES + 1), vocab())


def test_phonemes_input_names_unknown_symbols():
    with pytest.raises(ValueError, match=r"'g' \(U\+0067\), '😀' \(U\+1F600\)"):
        check_phonemes("həlˈO g😀 g", vocab())
    with pytest.raises(ValueError, match="empty"):
        check_phonemes("  ", vocab())
    with pytest.raises(ValueError, match="511 symbols exceed"):
        check_phonemes("a" * 511, vocab())
    assert check_phonemes("ni↓xau↓", vocab()) == "ni↓xau↓"


def test_phonemes_input_is_one_chunk_with_its_groups_as_words():
    chunk = chunk_phonemes("həlˈO  wˈɜːld, ni↓", vocab())
    assert chunk.phonemes == "həlˈO  wˈɜːld, ni↓" and chunk.text == ""
    assert [chunk.phonemes[s:e] for s, e in chunk.spans] == ["həlˈO", "wˈɜːld,", "ni↓"]
    assert [t.space for t in chunk.tokens] == ["  ", " ", ""]
