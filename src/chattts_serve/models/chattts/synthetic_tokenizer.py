"""A synthetic BERT WordPiece tokenizer in the official ChatTTS layout, for random test checkpoints.

The real ``asset/tokenizer`` vocabulary cannot be downloaded on our machines. This one has the official
size (21128 WordPiece entries + 50 ChatTTS control tokens at ids 21128..21177, the official ids), one
token per CJK character as the real bert-base-chinese vocab has, and the standard BERT pipeline
(lowercasing, CJK splitting, ``##`` continuation pieces), so both our tokenizer and the reference's
``BertTokenizerFast`` load it and produce the same ids.

Only the vocabulary is made up. Every other field mirrors the official files exactly, the hostile ones
included: ``tokenizer.json`` carries the official ``truncation`` (256, LongestFirst) and ``padding``
(Fixed 256, ``[PAD]``) blocks, which ``tokenizers`` applies on every ``encode`` unless the reader turns
them off; the 55 added tokens are all ``special``; ``tokenizer_config.json`` and
``special_tokens_map.json`` carry the official options and the control tokens as
``additional_special_tokens``. A test asset friendlier than the real one would hide real bugs.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import WordPiece

WORDPIECE_SIZE = 21128
MAX_LENGTH = 256
"""The official files' truncation / padding length (tokenizer.json blocks, tokenizer_config max_length)."""
BERT_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")

# ChatTTS control tokens in id order, starting at id 21128 (official ids).
CONTROL_TOKENS: tuple[str, ...] = (
    "[Sasr]",
    "[Pasr]",
    "[Easr]",
    "[Stts]",
    "[Ptts]",
    "[Etts]",
    "[Sbreak]",
    "[Pbreak]",
    "[Ebreak]",
    "[uv_break]",
    "[v_break]",
    "[lbreak]",
    "[llbreak]",
    "[undefine]",
    "[laugh]",
    "[spk_emb]",
    "[empty_spk]",
    "[music]",
    "[pure]",
    *(f"[break_{i}]" for i in range(8)),
    *(f"[laugh_{i}]" for i in range(3)),
    *(f"[oral_{i}]" for i in range(10)),
    *(f"[speed_{i}]" for i in range(10)),
)
assert len(CONTROL_TOKENS) == 50

_ENGLISH_WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had by "
    "word but not what all were we when your can said there use an each which she do how their if will up "
    "other about out many then them these so some her would make like him into time has look two more write "
    "go see number no way could people my than first water been call who oil its now find long down day did "
    "get come made may part hello world speech voice chat model audio sound test good morning thank thanks "
    "please yes today tomorrow weather nice great love life work home friend"
).split()
_SUFFIXES = ("s", "ed", "ing", "er", "est", "ly", "tion", "ment", "ness", "able")


def _wordpiece_vocab() -> list[str]:
    vocab = ["[PAD]"] + [f"[unused{i}]" for i in range(1, 100)] + ["[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    seen = set(vocab)

    def add(tok: str) -> None:
        if tok not in seen and len(vocab) < WORDPIECE_SIZE:
            seen.add(tok)
            vocab.append(tok)

    for ch in string.punctuation + string.digits + string.ascii_lowercase:
        add(ch)
    for ch in "，。、！？：；（）【】《》「」『』－…“”‘’～·":
        add(ch)
    for ch in string.digits + string.ascii_lowercase:
        add("##" + ch)
    for suf in _SUFFIXES:
        add("##" + suf)
    for w in _ENGLISH_WORDS:
        add(w)
    cp = 0x4E00
    while len(vocab) < WORDPIECE_SIZE:
        add(chr(cp))
        if cp % 16 == 0:  # a few CJK continuation pieces, as the real vocab has
            add("##" + chr(cp))
        cp += 1
    return vocab


def build_tokenizer() -> Tokenizer:
    vocab = {tok: i for i, tok in enumerate(_wordpiece_vocab())}
    tok = Tokenizer(WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=100))
    # The same pipeline transformers' BertTokenizer builds for do_lower_case=True.
    tok.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=True
    )
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS]:0 $A:0 [SEP]:0",
        pair="[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 101), ("[SEP]", 102)],
    )
    # As in the official file: the 5 BERT specials and the 50 control tokens, all special, none normalised.
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in BERT_SPECIALS])
    added = tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in CONTROL_TOKENS])
    if added != len(CONTROL_TOKENS) or tok.token_to_id(CONTROL_TOKENS[0]) != WORDPIECE_SIZE:
        raise RuntimeError("synthetic tokenizer: control tokens did not land at the official ids")
    # The official file's blocks: every plain `tokenizers` encode pads to 256 ids and cuts longer input.
    tok.enable_truncation(max_length=MAX_LENGTH, stride=0, strategy="longest_first", direction="right")
    tok.enable_padding(direction="right", pad_id=0, pad_type_id=0, pad_token="[PAD]", length=MAX_LENGTH)
    return tok


def _added_token_entry(content: str) -> dict:
    return {
        "content": content,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": True,
    }


def tokenizer_config(tok: Tokenizer) -> dict:
    """``tokenizer_config.json`` with the official fields (a ``BertTokenizer`` saved by transformers)."""
    added = {str(tok.token_to_id(t)): _added_token_entry(t) for t in (*BERT_SPECIALS, *CONTROL_TOKENS)}
    return {
        "added_tokens_decoder": added,
        "additional_special_tokens": list(CONTROL_TOKENS),
        "clean_up_tokenization_spaces": True,
        "cls_token": "[CLS]",
        "do_basic_tokenize": True,
        "do_lower_case": True,
        "mask_token": "[MASK]",
        "max_length": MAX_LENGTH,
        "model_max_length": 1000000000000000019884624838656,
        "never_split": None,
        "pad_to_multiple_of": None,
        "pad_token": "[PAD]",
        "pad_token_type_id": 0,
        "padding_side": "right",
        "sep_token": "[SEP]",
        "stride": 0,
        "strip_accents": None,
        "tokenize_chinese_chars": True,
        "tokenizer_class": "BertTokenizer",
        "truncation_side": "right",
        "truncation_strategy": "longest_first",
        "unk_token": "[UNK]",
    }


def special_tokens_map() -> dict:
    entry = lambda t: {k: v for k, v in _added_token_entry(t).items() if k != "special"}  # noqa: E731
    return {
        "additional_special_tokens": [entry(t) for t in CONTROL_TOKENS],
        "cls_token": entry("[CLS]"),
        "mask_token": entry("[MASK]"),
        "pad_token": entry("[PAD]"),
        "sep_token": entry("[SEP]"),
        "unk_token": entry("[UNK]"),
    }


def write_tokenizer(directory: Path) -> None:
    """Writes tokenizer.json, tokenizer_config.json and special_tokens_map.json into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(tok), indent=2) + "\n")
    (directory / "special_tokens_map.json").write_text(json.dumps(special_tokens_map(), indent=2) + "\n")
