"""Text normalisation and sentence splitting, bit-compatible with ``chattts==0.2.5``.

The reference pipeline (``ChatTTS.norm.Normalizer.__call__``) is, in order:

1. (``do_text_normalization``) detect the language unless given, run an optional registered
   language-specific normaliser on every text segment *outside* ``[...]`` tags, and for Chinese
   convert half-width punctuation to full-width (over the whole string, tags included).
2. If the string contains characters outside the allowed set (CJK unified ideographs, ASCII
   letters, ``，。、,.`` and space; well-formed ``[word]`` tags are ignored for this check), map a
   few punctuation marks to commas / full stops (whole string).
3. (``do_homophone_replacement``) replace characters the model mispronounces by homophones.
4. If step 2 found invalid characters, delete every disallowed character outside tags.

Tag splitting reproduces the reference's quirks exactly: an unclosed ``[`` swallows the rest of
the string (it is dropped when tags are recombined), and a stray ``]`` outside a tag registers an
empty tag, which shifts the pairing of later tags with text segments (``"a]b[x]c"`` becomes
``"abc[x]"`` when invalid characters trigger the rejection pass).

Deliberate deviations, only where the reference raises instead of returning a string: text with
lone surrogates and homophone replacement on (reference: ``UnicodeEncodeError``), and the empty
string with a registered normaliser for the detected language (reference: ``IndexError``).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from functools import lru_cache
from importlib import resources
from typing import Literal

__all__ = ["Normalizer", "detect_language", "load_default_homophones", "split_text"]

logger = logging.getLogger(__name__)

_CJK_CHAR = re.compile(r"[\u4e00-\u9fff]")
# ``\b`` is Unicode-aware, so a Latin run glued to a CJK character or digit is not a "word".
_EN_WORD = re.compile(r"\b[A-Za-z]+\b")
_DISALLOWED = re.compile(r"[^\u4e00-\u9fffA-Za-z，。、,. ]")
_WELL_FORMED_TAG = re.compile(r"\[\w+\]")
# Zero-width split points right after "。" and right after ". " + one whitespace character.
_SENTENCE_BOUNDARY = re.compile(r"(?<=。)|(?<=\.\s)")

# Applied when the text contains disallowed characters (data table from the reference).
_PUNCT_SIMPLIFY = str.maketrans(
    {
        "：": "，",
        "；": "，",
        "！": "。",
        "（": "，",
        "）": "，",
        "【": "，",
        "】": "，",
        "『": "，",
        "』": "，",
        "「": "，",
        "」": "，",
        "《": "，",
        "》": "，",
        "－": "，",
        ":": ",",
        ";": ",",
        "!": ".",
        "(": ",",
        ")": ",",
        ">": ",",
        "<": ",",
        "-": ",",
    }
)

# Applied to Chinese text when normalisation is on (data table from the reference).
# "[", "]" and "_" are deliberately absent so control tags survive.
_HALF_TO_FULL = str.maketrans(
    {
        "!": "！",
        '"': "“",
        "'": "‘",
        "#": "＃",
        "$": "＄",
        "%": "％",
        "&": "＆",
        "(": "（",
        ")": "）",
        ",": "，",
        "-": "－",
        "*": "＊",
        "+": "＋",
        ".": "。",
        "/": "／",
        ":": "：",
        ";": "；",
        "<": "＜",
        "=": "＝",
        ">": "＞",
        "?": "？",
        "@": "＠",
        "\\": "＼",
        "^": "＾",
        "`": "｀",
        "{": "｛",
        "|": "｜",
        "}": "｝",
        "~": "～",
    }
)

_REGISTER_PROBE = "test string 测试字符串"


def detect_language(text: str) -> Literal["zh", "en"]:
    """``"zh"`` if there are more CJK ideographs than (word-bounded) ASCII words, else ``"en"``."""
    n_cjk = len(_CJK_CHAR.findall(text))
    n_words = len(_EN_WORD.findall(text))
    return "zh" if n_cjk > n_words else "en"


def split_text(text: str) -> list[str]:
    """Split one input string into the pieces ``Chat.infer(..., split_text=True)`` synthesises.

    With a newline present the text is split on ``"\\n"`` only and empty pieces are kept;
    otherwise it is split after every ``。`` and after every ``.`` followed by whitespace, and
    empty pieces are dropped (so ``""`` gives ``[]``).
    """
    if "\n" in text:
        return text.split("\n")
    return [piece for piece in _SENTENCE_BOUNDARY.split(text) if piece]


@lru_cache(maxsize=1)
def load_default_homophones() -> dict[str, str]:
    """The vendored homophone map of the reference (loaded once)."""
    raw = (resources.files("chattts_serve") / "data" / "homophones_map.json").read_text("utf-8")
    return json.loads(raw)


@lru_cache(maxsize=1)
def _default_homophone_table() -> dict[int, int]:
    return _homophone_table(load_default_homophones())


def _homophone_table(mapping: dict[str, str]) -> dict[int, int]:
    table: dict[int, int] = {}
    for src, dst in mapping.items():
        for ch in (src, dst):
            # The reference matches UTF-16 code units, so only single BMP, non-surrogate
            # characters behave like plain character replacement.
            if not isinstance(ch, str) or len(ch) != 1:
                raise ValueError(f"homophone map entries must be single characters, got {ch!r}")
            cp = ord(ch)
            if cp > 0xFFFF or 0xD800 <= cp <= 0xDFFF:
                raise ValueError(f"homophone map character {ch!r} is outside the BMP")
        table[ord(src)] = ord(dst)
    return table


def _split_tags(text: str) -> tuple[list[str], list[str]]:
    """Reference-exact tag splitter (quirks included, see module docstring)."""
    segments: list[str] = []
    tags: list[str] = []
    seg: list[str] = []
    tag: list[str] | None = None  # None while outside a tag
    for ch in text:
        if ch == "[":
            segments.append("".join(seg))
            seg = []
            tag = ["["]  # an open, unclosed tag is silently abandoned
        elif tag is not None:
            tag.append(ch)
        else:
            seg.append(ch)
        if ch == "]":
            tags.append("" if tag is None else "".join(tag))
            tag = None
    if seg:
        segments.append("".join(seg))
    return segments, tags


def _map_outside_tags(text: str, fn: Callable[[str], str]) -> str:
    segments, tags = _split_tags(text)
    segments = [fn(s) for s in segments]
    if not tags:
        return segments[0] if segments else ""
    # Pair segment i with tag i; surplus tags are dropped, missing ones count as "".
    return "".join(s + (tags[i] if i < len(tags) else "") for i, s in enumerate(segments))


class Normalizer:
    """Reference-exact text normaliser (see module docstring)."""

    def __init__(self, homophones: dict[str, str] | None = None) -> None:
        if homophones is None:
            self._homophones = _default_homophone_table()
        else:
            self._homophones = _homophone_table(homophones)
        self.normalizers: dict[str, Callable[[str], str]] = {}

    def register(self, lang: str, fn: Callable[[str], str]) -> bool:
        """Register a language-specific normaliser applied to text outside tags.

        Like the reference it refuses a second registration for ``lang`` and probes ``fn`` with a
        test string, refusing it if it raises or does not return ``str``.
        """
        if lang in self.normalizers:
            logger.warning("normalizer for %r is already registered", lang)
            return False
        try:
            probe = fn(_REGISTER_PROBE)
        except Exception as exc:  # any failure means "unusable"
            logger.warning("normalizer for %r failed on a test string: %s", lang, exc)
            return False
        if not isinstance(probe, str):
            logger.warning("normalizer for %r must map str -> str, got %s", lang, type(probe).__name__)
            return False
        self.normalizers[lang] = fn
        return True

    def unregister(self, lang: str) -> bool:
        """Remove the normaliser for ``lang``; returns whether one was registered."""
        return self.normalizers.pop(lang, None) is not None

    def __call__(
        self,
        text: str,
        do_text_normalization: bool = True,
        do_homophone_replacement: bool = True,
        lang: Literal["zh", "en"] | str | None = None,
    ) -> str:
        if do_text_normalization:
            eff_lang = detect_language(text) if lang is None else lang
            fn = self.normalizers.get(eff_lang)
            if fn is not None:
                text = _map_outside_tags(text, fn)
            if eff_lang == "zh":
                text = text.translate(_HALF_TO_FULL)

        invalid = set(_DISALLOWED.findall(_WELL_FORMED_TAG.sub("", text)))
        if invalid:
            logger.debug("found invalid characters: %s", invalid)
            text = text.translate(_PUNCT_SIMPLIFY)

        if do_homophone_replacement:
            replaced = text.translate(self._homophones)
            if replaced != text and logger.isEnabledFor(logging.DEBUG):
                pairs = [f"{a}->{b}" for a, b in zip(text, replaced, strict=True) if a != b]
                logger.debug("replaced homophones: %s", ", ".join(pairs))
            text = replaced

        if invalid:
            text = _map_outside_tags(text, lambda s: _DISALLOWED.sub("", s))
        return text
