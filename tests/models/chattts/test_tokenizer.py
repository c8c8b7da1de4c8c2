"""models/chattts/tokenizer.py with the tiny checkpoint's (synthetic, official-layout) tokenizer."""

from __future__ import annotations

import json
import re
import unicodedata

import pytest
from tokenizers import Tokenizer as HFTokenizer

from chattts_serve.models.chattts.checkpoint import TOKENIZER_DIR
from chattts_serve.models.chattts.synthetic_tokenizer import CONTROL_TOKENS
from chattts_serve.models.chattts.tokenizer import Tokenizer, clean_up_tokenization, code_prompt, refine_prompt

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


# ---------------------------------------------------------------------------------------------------
# The official files' hostile fields: padding / truncation blocks, all-special added tokens.


def test_asset_carries_the_official_padding_and_truncation_blocks(tiny_ckpt):
    raw = json.loads((tiny_ckpt / TOKENIZER_DIR / "tokenizer.json").read_text())
    assert raw["truncation"] == {"direction": "Right", "max_length": 256, "strategy": "LongestFirst", "stride": 0}
    assert raw["padding"] == {
        "strategy": {"Fixed": 256},
        "direction": "Right",
        "pad_to_multiple_of": None,
        "pad_id": 0,
        "pad_type_id": 0,
        "pad_token": "[PAD]",
    }
    assert raw["normalizer"] == {
        "type": "BertNormalizer",
        "clean_text": True,
        "handle_chinese_chars": True,
        "strip_accents": None,
        "lowercase": True,
    }
    assert raw["pre_tokenizer"]["type"] == "BertPreTokenizer"
    assert raw["post_processor"]["type"] == "TemplateProcessing"
    assert raw["decoder"] == {"type": "WordPiece", "prefix": "##", "cleanup": True}
    model = raw["model"]
    assert (model["type"], model["unk_token"], model["continuing_subword_prefix"]) == ("WordPiece", "[UNK]", "##")
    assert model["max_input_chars_per_word"] == 100 and len(model["vocab"]) == 21128
    added = raw["added_tokens"]
    assert [a["id"] for a in added] == [0, 100, 101, 102, 103, *range(21128, 21178)]
    for a in added:
        assert (a["special"], a["normalized"], a["lstrip"], a["rstrip"], a["single_word"]) == (
            True,
            False,
            False,
            False,
            False,
        ), a
    config = json.loads((tiny_ckpt / TOKENIZER_DIR / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "BertTokenizer" and config["max_length"] == 256
    assert config["truncation_strategy"] == "longest_first" and config["padding_side"] == "right"
    assert config["clean_up_tokenization_spaces"] is True and config["do_lower_case"] is True
    assert config["model_max_length"] == 1000000000000000019884624838656
    assert config["additional_special_tokens"] == list(CONTROL_TOKENS)
    specials = json.loads((tiny_ckpt / TOKENIZER_DIR / "special_tokens_map.json").read_text())
    assert [t["content"] for t in specials["additional_special_tokens"]] == list(CONTROL_TOKENS)


def test_the_file_alone_would_pad_and_truncate(tiny_ckpt):
    """Guards the test asset: a plain `tokenizers` load applies the blocks (what a real user's file does)."""
    raw = HFTokenizer.from_file(str(tiny_ckpt / TOKENIZER_DIR / "tokenizer.json"))
    assert len(raw.encode("你好", add_special_tokens=False).ids) == 256
    assert len(raw.encode("好" * 300, add_special_tokens=False).ids) == 256


def test_encode_never_pads(tok):
    ids = tok.encode("你好")
    assert len(ids) == 2 and 0 not in ids


def test_encode_keeps_text_past_256_tokens(tok):
    text = "".join(chr(0x4E00 + (i * 7) % 5000) for i in range(300))
    ids = tok.encode(text)
    assert len(ids) == 300
    assert ids == [tok.encode(ch)[0] for ch in text]
    prompt = tok.encode(code_prompt(text))
    assert len(prompt) == 304 and prompt[-1] == 21132


ORACLE_TEXTS = [
    "今天天气真不错，我们一起去公园散步吧。",
    "Hello world, this is a test of chat tts.",
    "Hello WORLD! It's 2024, ok?",
    "Café naïve résumé",
    "abc 123 ok! testing unbelievable-ness 4567",
    "今天[uv_break]天气[laugh]很好[speed_5]。chat TTS 中英混读",
    "  spaces\tand\nnewlines  ",
    "xyzzyplughqwerty 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ☃",
    "一" * 300,
]


@pytest.mark.parametrize("text", ORACLE_TEXTS)
def test_ids_match_an_independent_bert_tokenizer(tok, tiny_ckpt, text):
    """Our ids equal those of a from-scratch BERT tokenizer (transformers' slow BertTokenizer algorithm:
    added tokens first, clean + CJK spacing + lowercase, whitespace/punctuation split, greedy WordPiece)
    on the same vocabulary: no padding, no truncation, whatever the file's blocks say."""
    raw = json.loads((tiny_ckpt / TOKENIZER_DIR / "tokenizer.json").read_text())
    added = {a["content"]: a["id"] for a in raw["added_tokens"]}
    assert tok.encode(text) == slow_bert_encode(text, raw["model"]["vocab"], added)


def test_refine_round_trip_on_the_official_layout(tok):
    """The refine pass decodes its ids to a string and re-encodes it (as the reference): the round trip
    must give back the same ids, padding-free, for CJK with control tokens, and English words."""
    text = "你好[uv_break]世界[laugh]今天天气很好"
    ids = tok.encode(text)
    assert tok.encode(tok.decode(ids)) == ids
    decoded = tok.decode(tok.encode("hello world, it's good"))
    assert decoded == "hello world, it's good" and "[PAD]" not in decoded


# --- the oracle ------------------------------------------------------------------------------------


def _is_cjk(cp: int) -> bool:
    return (
        0x4E00 <= cp <= 0x9FFF
        or 0x3400 <= cp <= 0x4DBF
        or 0x20000 <= cp <= 0x2A6DF
        or 0x2A700 <= cp <= 0x2B73F
        or 0x2B740 <= cp <= 0x2B81F
        or 0x2B820 <= cp <= 0x2CEAF
        or 0xF900 <= cp <= 0xFAFF
        or 0x2F800 <= cp <= 0x2FA1F
    )


def _is_punct(ch: str) -> bool:
    cp = ord(ch)
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(ch).startswith("P")


def _basic_tokens(text: str) -> list[str]:
    out = []
    for ch in text:
        cp = ord(ch)
        if cp == 0 or cp == 0xFFFD or (unicodedata.category(ch).startswith("C") and ch not in "\t\n\r"):
            continue
        if ch in " \t\n\r" or unicodedata.category(ch) == "Zs":
            out.append(" ")
        elif _is_cjk(cp):
            out.append(f" {ch} ")
        else:
            out.append(ch)
    words = []
    for word in "".join(out).lower().split():
        # strip_accents None with lowercase: accents go (NFD, drop combining marks), as transformers does.
        word = "".join(c for c in unicodedata.normalize("NFD", word) if unicodedata.category(c) != "Mn")
        piece = ""
        for ch in word:
            if _is_punct(ch):
                words += [piece] if piece else []
                words.append(ch)
                piece = ""
            else:
                piece += ch
        words += [piece] if piece else []
    return words


def _wordpiece(word: str, vocab: dict[str, int]) -> list[int]:
    if len(word) > 100:
        return [vocab["[UNK]"]]
    ids, start = [], 0
    while start < len(word):
        end = len(word)
        while end > start:
            sub = ("##" if start else "") + word[start:end]
            if sub in vocab:
                ids.append(vocab[sub])
                break
            end -= 1
        if end == start:
            return [vocab["[UNK]"]]
        start = end
    return ids


def slow_bert_encode(text: str, vocab: dict[str, int], added: dict[str, int]) -> list[int]:
    pattern = "(" + "|".join(re.escape(t) for t in sorted(added, key=len, reverse=True)) + ")"
    ids = []
    for part in re.split(pattern, text):
        if part in added:
            ids.append(added[part])
        elif part:
            for word in _basic_tokens(part):
                ids += _wordpiece(word, vocab)
    return ids
