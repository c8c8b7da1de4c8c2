"""Mandarin through misaki's zh G2P, the way ``KPipeline(lang_code="z")`` calls it, keeping the words.

For ``hexgrad/Kokoro-82M`` the package builds ``ZHG2P(version=None)``, whose ``legacy_call`` returns a
string only: digits to Chinese numerals (cn2an), full-width punctuation to ASCII, then each run of CJK
characters cut into words by jieba and each word to IPA (pypinyin), the words joined by one space;
everything else (punctuation, spaces, Latin letters) passes through as it is. This module runs the
same steps with misaki's own functions but keeps each jieba word and each piece of the rest as a
``Token``, so the joined phonemes are the package's string and every word knows its phonemes. A
token's ``text`` is the normalised text (``12`` reads ``十二``), as the phonemes were made from it.
"""

from __future__ import annotations

import logging
import re
from dataclasses import replace

from chattts_serve.models.kokoro.text.tokens import Token

_CJK = re.compile("[\u4e00-\u9fff]+|[^\u4e00-\u9fff]+")  # legacy_call's alternation
_MARKS = ";:,.!?\u2014\u2026\"()\u201c\u201d"  # the vocab's punctuation: one token each (chunking cuts there)
_PIECE = re.compile(rf"\s+|[{re.escape(_MARKS)}]|[^\s{re.escape(_MARKS)}]+")
_DROPPED = chr(815)  # legacy_call removes U+032F (combining inverted breve) from its result


class ZhG2P:
    """Import misaki's Chinese G2P (and its jieba, pypinyin, cn2an) once; ``tokens(text)`` per call."""

    def __init__(self) -> None:
        import cn2an
        import jieba
        from misaki.zh import ZHG2P

        jieba.setLogLevel(logging.WARNING)  # its dictionary-building notes are not ours to print
        self._an2cn = lambda s: cn2an.transform(s, "an2cn")
        self._cut = lambda s: jieba.lcut(s, cut_all=False)
        self._word2ipa = ZHG2P.word2ipa
        self._punctuation = ZHG2P.map_punctuation

    def tokens(self, text: str) -> list[Token]:
        if not text.strip():
            return []
        text = self._punctuation(self._an2cn(text))
        out: list[Token] = []
        for segment in _CJK.findall(text):
            if "\u4e00" <= segment[0] <= "\u9fff":
                words = self._cut(segment)
                for k, w in enumerate(words):
                    space = " " if k < len(words) - 1 else ""
                    out.append(Token(w, self._word2ipa(w).replace(_DROPPED, ""), space))
                continue
            for piece in _PIECE.findall(segment):
                if piece.isspace() and out:
                    last = out[-1]
                    out[-1] = replace(last, space=last.space + piece, text_space=last.text_space + piece)
                elif not piece.isspace():  # (text is stripped: whitespace never comes first)
                    out.append(Token(piece, piece.replace(_DROPPED, "")))
        return out

    def phonemize(self, text: str) -> str:
        """The string ``ZHG2P(version=None)(text)[0]`` gives."""
        return "".join(t.phonemes + t.space for t in self.tokens(text))
