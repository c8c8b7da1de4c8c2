"""Opt-in cleanup of text written for the eye, before it is spoken (``SamplingParams.text_cleanup``).

LLM answers and READMEs are markdown: read as they are, a voice spells out link targets, asterisks and
bullets. ``clean_markdown`` keeps what a person would read aloud: a link's text (not its target), code
without its backticks, headings and list items without their marks, a bare URL as its host, an e-mail
address as "name at host", and no emoji. Off by default: the reference speaks text as given, and the
fidelity tests hold only for text that reaches the normaliser unchanged.
"""

from __future__ import annotations

import re

TEXT_CLEANUPS = ("none", "markdown")

_FENCE = re.compile(r"^\s*(```|~~~).*$", re.MULTILINE)
_IMAGE = re.compile(r"!\[([^\]\n]*)\]\([^)\n]*\)")
_LINK = re.compile(r"\[([^\]\n]+)\]\((?:[^()\n]|\([^()\n]*\))*\)")  # a target may hold one level of (...)
_REF_LINK = re.compile(r"\[([^\]\n]+)\]\[[^\]\n]*\]")
_REF_DEFINITION = re.compile(r"^\s{0,3}\[[^\]\n]+\]:\s+\S+.*$", re.MULTILINE)
_AUTOLINK = re.compile(r"<((?:https?|ftp)://[^>\s]+|[^>\s@]+@[^>\s@]+)>")
_HTML_TAG = re.compile(r"</?[A-Za-z][A-Za-z0-9-]*(?:\s[^<>]*)?/?>")
_HEADING = re.compile(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$", re.MULTILINE)
_RULE = re.compile(r"^\s{0,3}([-*_])(\s*\1){2,}\s*$", re.MULTILINE)
_QUOTE = re.compile(r"^\s{0,3}>\s?", re.MULTILINE)
_BULLET = re.compile(r"^\s*[-*+]\s+(\[[ xX]\]\s+)?", re.MULTILINE)
_TABLE_RULE = re.compile(r"^\s*\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)*\|?\s*$", re.MULTILINE)
_STRONG = re.compile(r"(\*\*|__)(?=\S)(.+?)(?<=\S)\1")
# ASCII word characters only: emphasis sits right against CJK text (``*不要*在``), never inside a_word.
_EMPHASIS = re.compile(r"(?<![A-Za-z0-9*_])([*_])(?=\S)(.+?)(?<=\S)\1(?![A-Za-z0-9*_])")
_STRIKE = re.compile(r"~~(?=\S)(.+?)(?<=\S)~~")
_CODE = re.compile(r"`+([^`]+?)`+")
_HOST = r"([A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+)(?::\d+)?"
_TAIL = r"(?:[/?#][^\s<>()\[\]]*[^\s<>()\[\].,;:!?'\"])?/?"  # a sentence's full stop is not the URL's
_URL = re.compile(r"\b(?:https?|ftp)://(?:www\.)?" + _HOST + _TAIL)
_WWW = re.compile(r"\bwww\." + _HOST + _TAIL)
_EMAIL = re.compile(r"\b([A-Za-z0-9._%+-]+)@([A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+)\b")
# Pictographs, dingbats, flags, keycaps, skin tones, the variation selector and the zero-width joiner that
# glue emoji sequences together.
_EMOJI = re.compile(
    "[\U0001f000-\U0001faff\U0001f1e6-\U0001f1ff\u2600-\u27bf\u2b00-\u2bff\u2300-\u23ff"
    "\ufe0f\ufe0e\u200d\u20e3\U000e0020-\U000e007f]"
)
_BLANKS = re.compile(r"[ \t]+")


def clean_markdown(text: str) -> str:
    """``text`` as a person would read it aloud (see the module docstring). Line breaks are kept, so
    headings and list items stay sentences of their own for the splitter."""
    text = _FENCE.sub("", text)
    text = _REF_DEFINITION.sub("", text)
    text = _IMAGE.sub(r"\1", text)
    text = _LINK.sub(r"\1", text)
    text = _REF_LINK.sub(r"\1", text)
    text = _AUTOLINK.sub(r"\1", text)
    text = _HTML_TAG.sub("", text)
    text = _TABLE_RULE.sub("", text)
    text = _RULE.sub("", text)
    text = _HEADING.sub(r"\1", text)
    text = _QUOTE.sub("", text)
    text = _BULLET.sub("", text)
    text = _CODE.sub(r"\1", text)
    text = _STRONG.sub(r"\2", text)
    text = _STRIKE.sub(r"\1", text)
    text = _EMPHASIS.sub(r"\2", text)
    text = _EMAIL.sub(r"\1 at \2", text)
    text = _URL.sub(r"\1", text)
    text = _WWW.sub(r"\1", text)
    text = text.replace("|", " ")  # table cells
    text = _EMOJI.sub("", text)
    lines = (_BLANKS.sub(" ", line).strip() for line in text.splitlines())
    return "\n".join(line for line in lines if line)
