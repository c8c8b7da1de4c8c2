"""model/tokenizer.py with the tiny checkpoint's (synthetic, official-layout) tokenizer."""

from __future__ import annotations

import pytest

from chattts_serve.model.checkpoint import TOKENIZER_DIR
from chattts_serve.model.tokenizer import Tokenizer, clean_up_tokenization, code_prompt, refine_prompt

OFFICIAL_IDS = {
    "[Stts]": 21131,
    "[Ptts]": 21132,
    "[Ebreak]": 21136,
    "[uv_break]": 21137,
    "[laugh]": 21142,
    "[spk_emb]": 21143,
    "[empty_spk]": 21144,
    "[break_0]": 21147,
    **{f"[speed_{i}]": 21168 + i for i in range(10)},
}


@pytest.fixture(scope="module")
def tok(tiny_ckpt) -> Tokenizer:
    return Tokenizer(tiny_ckpt / TOKENIZER_DIR)


def test_vocab_size(tok):
    assert tok.vocab_size == 21178


@pytest.mark.parametrize("token,expected", sorted(OFFICIAL_IDS.items()))
def test_official_control_token_ids(tok, token, expected):
    assert tok.token_id(token) == expected
    assert tok.encode(token) == [expected]
    assert token in tok.control_tokens


def test_attribute_ids(tok):
    assert tok.spk_emb_id == 21143
    assert tok.break_0_id == 21147
    assert tok.eos_id == 21136


def test_token_id_unknown_raises(tok):
    with pytest.raises(ValueError, match="no token"):
        tok.token_id("[definitely_not_a_token]")


@pytest.mark.parametrize("text", ["你好世界", "今天天气很好", "我们去公园散步吧"])
def test_one_token_per_cjk_character(tok, text):
    ids = tok.encode(text)
    assert len(ids) == len(text)
    for ch, i in zip(text, ids, strict=True):
        assert tok.encode(ch) == [i]
        assert tok.decode([i]) == ch
    assert all(i < 21128 for i in ids)  # WordPiece ids, below the control tokens


def test_control_tokens_stay_single_ids_inside_text(tok):
    ids = tok.encode("你好[uv_break]世界[laugh]。[speed_3]")
    assert len(ids) == 8
    assert ids[2] == 21137 and ids[5] == 21142 and ids[7] == 21171
    assert ids[:2] == tok.encode("你好") and ids[3:5] == tok.encode("世界")


def test_no_special_tokens_added(tok):
    ids = tok.encode("你好")
    assert 101 not in ids and 102 not in ids  # no [CLS] / [SEP]


@pytest.mark.parametrize("text", ["你好世界", "今天天气很好。", "你好[uv_break]世界[laugh]"])
def test_cjk_round_trip(tok, text):
    ids = tok.encode(text)
    decoded = tok.decode(ids)
    assert tok.encode(decoded) == ids
    assert decoded.replace(" ", "") == text


def test_decode_applies_space_cleanup(tok):
    assert tok.clean_up_spaces  # the tiny checkpoint's tokenizer_config.json asks for it
    assert tok.decode(tok.encode("hello, world. i'm here, don't go!")) == "hello, world. i'm here, don't go!"


def test_clean_up_tokenization():
    assert clean_up_tokenization("hello , world . ok ? yes !") == "hello, world. ok? yes!"
    assert clean_up_tokenization("do n't , i 'm , he 's , we 've , they 're") == "don't, i'm, he's, we've, they're"
    assert clean_up_tokenization("a ' b") == "a'b"
    assert clean_up_tokenization("你 好 。") == "你 好 。"  # only the English rules


def test_unknown_tags(tok):
    assert tok.unknown_tags("你好[foo]世界") == ["[foo]"]
    assert tok.unknown_tags("你好[uv_break]世界[laugh][speed_5]") == []
    assert tok.unknown_tags("[foo][uv_break][bar]") == ["[foo]", "[bar]"]
    assert tok.unknown_tags("no tags at all") == []


def test_refine_prompt():
    assert refine_prompt("你好") == "[Sbreak]你好[Pbreak]"
    assert refine_prompt("你好", "[oral_2][laugh_0][break_6]") == "[Sbreak]你好[Pbreak][oral_2][laugh_0][break_6]"


def test_code_prompt_default():
    assert code_prompt("你好") == "[Stts][spk_emb][speed_5]你好[Ptts]"


def test_code_prompt_variants():
    assert code_prompt("  你好 ", "[speed_2]", has_speaker=False) == "[Stts][empty_spk][speed_2]你好[Ptts]"
    assert code_prompt("你好", "", txt_smp="样本") == "[Stts][spk_emb]样本你好[Ptts]"
    assert code_prompt(" 你好 ", "") == "[Stts][spk_emb]你好[Ptts]"


def test_code_prompt_strips_template_tags_from_user_text():
    text = " [Stts]你[spk_emb]好[empty_spk][uv_break] "
    assert code_prompt(text) == "[Stts][spk_emb][speed_5]你好[uv_break][Ptts]"
    assert code_prompt(text, has_speaker=False) == "[Stts][empty_spk][speed_5]你好[uv_break][Ptts]"


def test_code_prompt_encodes_to_expected_ids(tok):
    ids = tok.encode(code_prompt("你好"))
    assert ids[:3] == [21131, 21143, 21173] and ids[-1] == 21132
    assert ids[3:-1] == tok.encode("你好")
