"""Word times from durations: KPipeline.join_timestamps' rule."""

from __future__ import annotations

import pytest

from chattts_serve.models.kokoro.text import Token, WordTime, chunk_phonemes, word_timestamps
from chattts_serve.models.kokoro.text.tokens import make_chunk

from .golden import golden, vocab

JOIN = golden()["join"]


def test_hand_made_durations():
    chunk = make_chunk([Token("hi", "ab", " ", " "), Token("yo", "c")])
    # ids: BOS a b ' ' c EOS
    words = word_timestamps(chunk, [5, 2, 4, 6, 8, 10], samples_per_frame=600, sample_rate=24000)
    # start: (5 - 3) frames = 0.05 s; "hi" = 6 frames and half the space (3): 0.05 + 9/40 = 0.275
    # "yo" starts there, and ends after the rest of the space (3) and its own 8 frames: 0.275 + 11/40
    assert words == [WordTime("hi", 0.05, 0.275), WordTime("yo", 0.275, 0.55)]
    assert word_timestamps(chunk, [5, 2, 4, 6, 8, 10], 300, 24000) == [("hi", 0.025, 0.1375), ("yo", 0.1375, 0.275)]


def test_a_short_boundary_starts_at_zero():
    chunk = make_chunk([Token("a", "a")])
    assert word_timestamps(chunk, [1, 4, 9], 600, 24000) == [("a", 0.0, 0.1)]  # 4 frames


@pytest.mark.parametrize("case", JOIN, ids=[f"{c['lang']}-{c['text'][:12]}-{i}" for i, c in enumerate(JOIN)])
def test_times_are_join_timestamps(case):
    tokens = [Token(t, p, " " if w else "", w) for t, p, w in case["tokens"]]
    chunk = make_chunk(tokens)
    ours = word_timestamps(chunk, case["durations"], 600, 24000)
    theirs = [(t[0], *ts) for t, ts in zip(case["tokens"], case["times"], strict=True) if t[1]]
    assert ours == theirs  # exact: the same half-frame counts over the same divisor


def test_the_golden_cases_cover_a_chunk_cut_mid_text():
    # a chunk whose last token had a space (stripped): the package gives it half the end boundary
    assert any(c["tokens"][-1][2] for c in JOIN)


def test_symbols_the_vocab_lacks_do_not_shift_later_words():
    chunk = make_chunk([Token("hey", "hg", " ", " "), Token("yo", "a")])  # "g" is not in the vocab
    # ids: BOS h ' ' a EOS (the "g" dropped by phonemes_to_ids): "hey" 4 frames + 1 (half the space),
    # "yo" the other half and 6 frames
    assert word_timestamps(chunk, [3, 4, 2, 6, 1], 600, 24000, vocab=vocab()) == [
        ("hey", 0.0, 0.125), ("yo", 0.125, 0.3)
    ]
    with pytest.raises(ValueError, match="durations: 5 values for 6 input ids.*pass the vocab"):
        word_timestamps(chunk, [3, 4, 2, 6, 1], 600, 24000)


def test_a_token_without_phonemes_takes_only_its_own_space():
    chunk = make_chunk([Token("a", "a", " ", " "), Token("?", "", " ", " "), Token("b", "b")])
    # ids: BOS a ' ' ' ' b EOS
    words = word_timestamps(chunk, [3, 4, 2, 6, 8, 1], 600, 24000)
    # "a": 4 frames + 1 (half its space); then the other half (1) and half the empty token's space (3)
    # lie before "b" starts (0.125 + 4/40), and "b" ends after the rest (3) and its 8 frames
    assert words == [("a", 0.0, 0.125), ("b", 0.225, 0.5)]


def test_phonemes_input_gets_word_times():
    chunk = chunk_phonemes("ab c", vocab())
    assert word_timestamps(chunk, [5, 2, 4, 6, 8, 10], 600, 24000, vocab=vocab()) == [
        ("ab", 0.05, 0.275), ("c", 0.275, 0.55)
    ]
