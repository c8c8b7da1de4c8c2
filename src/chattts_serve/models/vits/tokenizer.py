"""Text -> input ids as transformers' ``VitsTokenizer`` makes them, from a checkpoint's ``vocab.json`` and
``tokenizer_config.json`` (``add_blank``, ``normalize``, ``phonemize``, ``is_uroman``, ``language``), without
transformers.

The steps, in its order (checked against it in tests/models/vits/test_tokenizer.py):

1. ``normalize``: each position keeps a vocabulary entry (``vocab.json``, then the added tokens) that matches
   there verbatim, in the vocabulary's order; any other character is lower-cased;
2. ``language`` "ron": "ț" (t with comma) becomes "ţ" (t with cedilla), as its vocabulary spells it;
3. ``is_uroman`` and the text has a non-ASCII character: romanised with ``uroman`` (the isi-nlp romaniser,
   PyPI ``uroman``: the optional extra ``chattts-serve[vits-uroman]``). transformers only warns and goes on
   when it is missing (the untransliterated characters are then dropped, so the speech silently loses them);
   we raise an error that names the package;
4. ``phonemize``: espeak phonemes through ``phonemizer`` (GPL espeak-ng; the MMS checkpoints do not use it);
   otherwise, with ``normalize``, every character outside ``vocab.json`` is dropped, then the ends stripped;
5. the text splits at its special tokens (the pad and unk tokens, and ``added_tokens.json``): those become
   their ids as they are; every other piece becomes one id per character (unknown: the unk id) with, under
   ``add_blank``, the blank (id 0) before, between and after them. So MMS's English pad token "k", a letter,
   is emitted without blanks around it, exactly as transformers does.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

UROMAN_HINT = "pip install 'chattts-serve[vits-uroman]' (the uroman package)"


class TokenizerError(ValueError):
    """The tokenizer files are missing or malformed, or the text needs a package that is not installed."""


@dataclass(frozen=True)
class VitsTokenizer:
    vocab: Mapping[str, int]
    add_blank: bool = True
    normalize: bool = True
    phonemize: bool = False
    is_uroman: bool = False
    language: str | None = None
    pad_token: str = "<pad>"
    unk_token: str = "<unk>"
    added_tokens: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        words = list(self.vocab) + [w for w in self.added_tokens if w not in self.vocab]
        by_first: dict[str, list[str]] = {}
        for word in words:
            if word:
                by_first.setdefault(word[0], []).append(word)
        object.__setattr__(self, "_by_first", by_first)
        specials = [t for t in (self.pad_token, self.unk_token, *self.added_tokens) if t]
        specials = sorted(set(specials), key=len, reverse=True)  # longest first at a position
        pattern = re.compile("|".join(re.escape(t) for t in specials)) if specials else None
        object.__setattr__(self, "_special_re", pattern)
        blank = 0 if 0 in set(self.vocab.values()) else self.unk_id
        object.__setattr__(self, "_blank", blank)

    @classmethod
    def from_dir(cls, root: str | Path) -> VitsTokenizer:
        root = Path(root)
        vocab = _read_json(root / "vocab.json")
        settings = _read_json(root / "tokenizer_config.json")
        if not isinstance(vocab, dict) or not all(isinstance(v, int) for v in vocab.values()):
            raise TokenizerError(f"{root / 'vocab.json'}: expected an object of token -> integer id")
        if not isinstance(settings, dict):
            raise TokenizerError(f"{root / 'tokenizer_config.json'}: expected a JSON object")
        added: dict[str, int] = {}
        if (root / "added_tokens.json").is_file():
            raw = _read_json(root / "added_tokens.json")
            if not isinstance(raw, dict) or not all(isinstance(v, int) for v in raw.values()):
                raise TokenizerError(f"{root / 'added_tokens.json'}: expected an object of token -> integer id")
            added.update(raw)
        specials: dict[str, Any] = {}
        if (root / "special_tokens_map.json").is_file():
            raw = _read_json(root / "special_tokens_map.json")
            if isinstance(raw, dict):
                specials = {k: _token_text(v) for k, v in raw.items()}
        pad = _token_text(settings.get("pad_token", specials.get("pad_token", "<pad>")))
        unk = _token_text(settings.get("unk_token", specials.get("unk_token", "<unk>")))
        # transformers appends a special token missing from the vocabulary after it, in its order of special
        # token attributes (unk before pad), as added_tokens.json records it.
        next_id = max([*vocab.values(), *added.values(), -1]) + 1
        for token in (unk, pad):
            if token not in vocab and token not in added:
                added[token] = next_id
                next_id += 1
        return cls(vocab=dict(vocab), add_blank=bool(settings.get("add_blank", True)),
                   normalize=bool(settings.get("normalize", True)), phonemize=bool(settings.get("phonemize", True)),
                   is_uroman=bool(settings.get("is_uroman", False)), language=settings.get("language"),
                   pad_token=pad, unk_token=unk, added_tokens=added)

    @property
    def unk_id(self) -> int:
        if self.unk_token in self.vocab:
            return self.vocab[self.unk_token]
        return self.added_tokens.get(self.unk_token, 0)

    def _token_id(self, token: str) -> int:
        if token in self.vocab:
            return self.vocab[token]
        if token in self.added_tokens:
            return self.added_tokens[token]
        return self.unk_id

    def prepare(self, text: str) -> str:
        """Steps 1-4: the text the ids are made from."""
        if self.normalize:
            text = self._lower_outside_vocab(text)
        if self.language == "ron":
            text = text.replace("ț", "ţ")
        if self.is_uroman and re.search(r"[^\x00-\x7F]", text):
            text = romanize(text)
        if self.phonemize:
            text = _phonemize(text)
        elif self.normalize:
            text = "".join(c for c in text if c in self.vocab).strip()
        return text

    def encode(self, text: str) -> list[int]:
        """Input ids for ``text`` (blanks included); empty when nothing of the text is in the vocabulary."""
        return self.encode_aligned(text)[1]

    def encode_aligned(self, text: str) -> tuple[str, list[int], list[int]]:
        """``encode`` with its alignment: the prepared text (``prepare``), the ids, and for each id the index in
        the prepared text of the character (or special token) it spells, -1 for a blank. Characters map to ids
        one to one, so a word of the prepared text is exactly a run of ids (word timings from durations)."""
        text = self.prepare(text)
        ids: list[int] = []
        chars: list[int] = []
        pos = 0
        pieces: list[tuple[int, str, bool]] = []
        if self._special_re is not None:
            for match in self._special_re.finditer(text):
                pieces.append((pos, text[pos : match.start()], False))
                pieces.append((match.start(), match.group(0), True))
                pos = match.end()
        pieces.append((pos, text[pos:], False))
        for start, piece, special in pieces:
            if special:
                ids.append(self._token_id(piece))
                chars.append(start)
            elif piece:
                for i, c in enumerate(piece):
                    if self.add_blank:
                        ids.append(self._blank)
                        chars.append(-1)
                    ids.append(self._token_id(c))
                    chars.append(start + i)
                if self.add_blank:
                    ids.append(self._blank)
                    chars.append(-1)
        return text, ids, chars

    def _lower_outside_vocab(self, text: str) -> str:
        out: list[str] = []
        i = 0
        by_first: dict[str, list[str]] = self._by_first  # type: ignore[attr-defined]
        while i < len(text):
            for word in by_first.get(text[i], ()):
                if text.startswith(word, i):
                    out.append(word)
                    i += len(word)
                    break
            else:
                out.append(text[i].lower())
                i += 1
        return "".join(out)


def romanize(text: str) -> str:
    return _uroman().romanize_string(text)


@functools.cache
def _uroman():
    """One romaniser per process: building it reads its tables (~6 s; transformers builds one per call)."""
    try:
        import uroman
    except ImportError:
        raise TokenizerError(
            "this checkpoint's tokenizer_config.json sets is_uroman: its text must be romanised with uroman, "
            f"which is not installed: {UROMAN_HINT}"
        ) from None
    return uroman.Uroman()


def _phonemize(text: str) -> str:
    try:
        import phonemizer
    except ImportError:
        raise TokenizerError(
            "this checkpoint's tokenizer_config.json sets phonemize: its text must become espeak phonemes through "
            "the phonemizer package (and espeak-ng, GPL), which is not installed"
        ) from None
    text = phonemizer.phonemize(text, language="en-us", backend="espeak", strip=True, preserve_punctuation=True,
                                with_stress=True)
    return re.sub(r"\s+", " ", text)


def _token_text(value: Any) -> str:
    """A special token as tokenizer files spell it: a string, or an AddedToken dict with its ``content``."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return str(value)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TokenizerError(f"no {path.name} at {path.parent}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TokenizerError(f"{path}: not valid JSON ({exc})") from None
