"""Text <-> ids with the official ``asset/tokenizer/tokenizer.json`` (through ``tokenizers``), and the
prompt templates of both GPT passes, built exactly as the reference builds them."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

# Control tokens a user may write inside text (word level) or in prompts.
_TAG = re.compile(r"\[[^\[\]]*\]")
# Tags the templates insert themselves; stripped from user text by the code template (as the reference).
_TEMPLATE_TAGS = ("[Stts]", "[spk_emb]", "[empty_spk]")
# BERT's own special tokens are not ChatTTS control tokens and are not accepted in user text.
_BERT_SPECIALS = frozenset({"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"})


class Tokenizer:
    def __init__(self, directory: str | Path) -> None:
        directory = Path(directory)
        self._tok = HFTokenizer.from_file(str(directory / "tokenizer.json"))
        # The official tokenizer.json pads every encoding to 256 [PAD] ids and cuts longer input
        # (its "padding" / "truncation" blocks). The reference calls transformers without padding or
        # truncation, which turns both off per call: so do we, whatever the file says.
        self._tok.no_padding()
        self._tok.no_truncation()
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        # transformers applies its Python-level space clean-up on decode when the config asks for it
        # (default False in transformers 5); the refine pass decodes and re-encodes, so it matters.
        self.clean_up_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.control_tokens = frozenset(
            t.content
            for t in self._tok.get_added_tokens_decoder().values()
            if _TAG.fullmatch(t.content) and t.content not in _BERT_SPECIALS and not t.content.startswith("[unused")
        )
        self.spk_emb_id = self.token_id("[spk_emb]")
        self.break_0_id = self.token_id("[break_0]")
        self.eos_id = self.token_id("[Ebreak]")

    def token_id(self, token: str) -> int:
        i = self._tok.token_to_id(token)
        if i is None:
            raise ValueError(f"tokenizer has no token {token!r}")
        return i

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        text = self._tok.decode(ids, skip_special_tokens=False)
        if self.clean_up_spaces:
            text = clean_up_tokenization(text)
        return text

    def unknown_tags(self, text: str) -> list[str]:
        """``[...]`` tags in ``text`` that are not control tokens of this tokenizer."""
        return [t for t in _TAG.findall(text) if t not in self.control_tokens]


def clean_up_tokenization(text: str) -> str:
    """transformers' ``clean_up_tokenization`` (spaces before punctuation and English contractions)."""
    for a, b in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(a, b)
    return text


def refine_prompt(text: str, prompt: str = "") -> str:
    """Template of the refine_text pass: the model continues after ``prompt`` until ``[Ebreak]``."""
    return f"[Sbreak]{text}[Pbreak]{prompt}"


def code_prompt(text: str, prompt: str = "[speed_5]", has_speaker: bool = True, txt_smp: str = "") -> str:
    """Template of the infer_code pass."""
    for tag in _TEMPLATE_TAGS:
        text = text.replace(tag, "")
    text = prompt + text.strip() if prompt else text.strip()
    return f"[Stts]{'[spk_emb]' if has_speaker else '[empty_spk]'}{txt_smp}{text}[Ptts]"
