"""engine/prompt_fit.py: which passes speak a sentence whose prompt does not fit a slot (pure; a token per
character stands in for the tokenizer)."""

from __future__ import annotations

import pytest

from chattts_serve.engine.prompt_fit import MAX_PARTS, Part, fit, shares

FIXED = 10  # template and voice sample


def plen(text: str) -> int:
    return FIXED + len(text)


def check(parts: list[Part], text: str, min_new: int, max_new: int, max_len: int) -> None:
    assert "".join(p.text for p in parts) == text
    assert sum(p.min_new_tokens for p in parts) == min_new and sum(p.max_new_tokens for p in parts) == max_new
    assert all(plen(p.text) + p.max_new_tokens <= max_len for p in parts)
    assert all(p.min_new_tokens <= p.max_new_tokens for p in parts)


def test_a_pass_that_fits_is_left_whole():
    text = "今天天气不错，我们去公园。"
    assert fit(text, plen, 5, 40, FIXED + len(text) + 40) == [Part(text, 5, 40)]


def test_a_long_pass_is_cut_after_its_marks_into_the_fewest_parts():
    text = "今天天气不错[uv_break]我们去公园[lbreak]明天见。后天也见。"
    parts = fit(text, plen, 20, 20, 40)  # whole: 10 + 33 + 20 > 40; in three: 10 + 11 + 7 fits
    assert parts is not None and len(parts) == 3
    check(parts, text, 20, 20, 40)
    assert [p.text for p in parts] == ["今天天气不错[uv_break]", "我们去公园[lbreak]", "明天见。后天也见。"]


def test_a_cap_that_keeps_half_is_shortened_rather_than_the_sentence_cut():
    """A long voice sample with room for most of max_new_tokens: one pass, as the reference speaks it
    (speech ends long before the cap), not a sentence cut at its comma."""
    text = "今天天气不错，我们去公园。"
    assert fit(text, plen, 0, 100, plen(text) + 60) == [Part(text, 0, 60)]


def test_without_marks_the_cap_is_shortened_while_min_new_tokens_fits():
    text = "今天天气不错我们去公园"
    assert fit(text, plen, 5, 100, 60) == [Part(text, 5, 60 - plen(text))]


def test_without_marks_and_a_long_min_new_tokens_the_text_is_cut_between_characters():
    text = "今天天气不错我们去公园"
    parts = fit(text, plen, 40, 40, 40)  # one pass: 21 + 40 > 40
    assert parts is not None and len(parts) > 1
    check(parts, text, 40, 40, 40)


def test_no_split_fits_a_sample_that_fills_the_slot():
    assert fit("今天天气不错。", lambda t: 38 + len(t), 4, 4, 40) is None


def test_a_pass_is_never_cut_into_more_than_max_parts():
    text = "字" * 100
    # One character and one audio token per part would fit: 17 parts and more are refused.
    assert fit(text, lambda t: 38 + len(t), MAX_PARTS + 1, MAX_PARTS + 1, 40) is None


@pytest.mark.parametrize(("total", "k", "out"), [(10, 3, [4, 3, 3]), (0, 2, [0, 0]), (7, 7, [1] * 7)])
def test_shares_are_even_and_add_up(total, k, out):
    assert shares(total, k) == out
