"""A synthetic BERT WordPiece tokenizer in the official ChatTTS layout, for random test checkpoints.

The real ``asset/tokenizer`` vocabulary cannot be downloaded on our machines. This one has the official
size (21128 WordPiece entries + 50 ChatTTS control tokens at ids 21128..21177, the official ids), one
token per CJK character as the real bert-base-chinese vocab has, and the standard BERT pipeline
(lowercasing, CJK splitting, ``##`` continuation pieces), so both our tokenizer and the reference's
``BertTokenizerFast`` load it and produce the same ids.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import WordPiece

WORDPIECE_SIZE = 21128

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
    bert_specials = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in bert_specials])
    added = tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in CONTROL_TOKENS])
    if added != len(CONTROL_TOKENS) or tok.token_to_id(CONTROL_TOKENS[0]) != WORDPIECE_SIZE:
        raise RuntimeError("synthetic tokenizer: control tokens did not land at the official ids")
    return tok


def write_tokenizer(directory: Path) -> None:
    """Writes tokenizer.json, tokenizer_config.json and special_tokens_map.json into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    tok.save(str(directory / "tokenizer.json"))
    specials = {
        "cls_token": "[CLS]",
        "mask_token": "[MASK]",
        "pad_token": "[PAD]",
        "sep_token": "[SEP]",
        "unk_token": "[UNK]",
    }
    config = {
        "tokenizer_class": "BertTokenizerFast",
        "do_lower_case": True,
        "tokenize_chinese_chars": True,
        "strip_accents": None,
        "clean_up_tokenization_spaces": True,
        "model_max_length": 1000000000000000019884624838656,
        **specials,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (directory / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")
