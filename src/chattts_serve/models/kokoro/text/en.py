"""English through misaki: its spaCy G2P where the spaCy model is installed, else espeak-ng.

``KPipeline(lang_code="a"|"b")`` uses ``misaki.en.G2P`` (spaCy's ``en_core_web_sm``, which is not on
PyPI and which misaki would download at start-up: here it is used only when already installed) with
espeak-ng for words out of its lexicon. Without spaCy, misaki's ``EspeakG2P`` phonemizes the whole
line (espeak-ng is GPL-3.0: an optional extra, ``chattts-serve[kokoro-espeak]``); it returns a string
only, so the words are recovered by phonemizing each input word alone (one espeak call for all) to
learn how many output words each one made, and grouping the line's output words by those counts.
Where the counts disagree (rare: espeak read across words), each word's own phonemes are used.
"""

from __future__ import annotations

import importlib.util

from chattts_serve.models.kokoro.text.tokens import Token

SPACY_MODEL = "en_core_web_sm"  # what misaki.en.G2P(trf=False) loads
MARKS = ";:,.!?\u2014\u2026\"()\u201c\u201d"


def spacy_available() -> bool:
    return importlib.util.find_spec("spacy") is not None and importlib.util.find_spec(SPACY_MODEL) is not None


def espeak_available() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("phonemizer", "espeakng_loader"))


class SpacyEnG2P:
    """``misaki.en.G2P`` as ``KPipeline`` builds it (espeak-ng fallback when installed, ``unk=""``)."""

    def __init__(self, british: bool) -> None:
        from misaki import en

        fallback = None
        if espeak_available():
            from misaki.espeak import EspeakFallback

            fallback = EspeakFallback(british=british)
        self._g2p = en.G2P(trf=False, british=british, fallback=fallback, unk="")

    def tokens(self, text: str) -> list[Token]:
        _, mtokens = self._g2p(text)
        return tokens_from_misaki(mtokens)


def tokens_from_misaki(mtokens) -> list[Token]:
    """misaki's ``MToken``s as ``KPipeline.en_tokenize`` reads them (``None`` phonemes are ``""``)."""
    return [Token(t.text, t.phonemes or "", " " if t.whitespace else "", t.whitespace) for t in mtokens]


class EspeakEnG2P:
    """misaki's ``EspeakG2P`` on the whole line, with the words recovered (see the module's docstring)."""

    def __init__(self, british: bool) -> None:
        from misaki.espeak import EspeakG2P

        self._g2p = EspeakG2P(language="en-gb" if british else "en-us")

    def tokens(self, text: str) -> list[Token]:
        words = text.split()
        if not words:
            return []
        said = self._g2p(text)[0].split()
        counts = [len(p.split()) for p in self._g2p.backend.phonemize(words)]
        if sum(counts) == len(said):
            groups, k = [], 0
            for n in counts:
                groups.append(" ".join(said[k : k + n]))
                k += n
        else:
            groups = [self._g2p(w)[0] for w in words]
        out: list[Token] = []
        for i, (w, p) in enumerate(zip(words, groups, strict=True)):
            out.extend(split_marks(w, p, "" if i == len(words) - 1 else " "))
        return out


def split_marks(word: str, phonemes: str, space: str) -> list[Token]:
    """A word with its leading and trailing punctuation as tokens of their own (the chunker cuts at
    them, as misaki's tokens let ``KPipeline`` cut), where graphemes and phonemes carry the same marks."""
    head: list[Token] = []
    tail: list[Token] = []
    while len(word) > 1 and phonemes and word[-1] in MARKS and phonemes[-1] == word[-1]:
        tail.insert(0, Token(word[-1], word[-1]))
        word, phonemes = word[:-1], phonemes[:-1]
    while len(word) > 1 and phonemes and word[0] in MARKS and phonemes[0] == word[0]:
        head.append(Token(word[0], word[0]))
        word, phonemes = word[1:], phonemes[1:]
    pieces = [*head, Token(word, phonemes), *tail]
    last = pieces[-1]
    pieces[-1] = Token(last.text, last.phonemes, space, space)
    return pieces
