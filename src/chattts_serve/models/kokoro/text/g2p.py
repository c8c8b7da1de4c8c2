"""Text to phonemes for Kokoro: one object per language, built once, called per request."""

from __future__ import annotations

from chattts_serve.models.kokoro.text import en
from chattts_serve.models.kokoro.text.tokens import Token, join_phonemes

LANGS = {"a": "American English", "b": "British English", "z": "Mandarin Chinese"}
ALIASES = {"en-us": "a", "en": "a", "en-gb": "b", "zh": "z", "cmn": "z"}
ENGLISH_BACKENDS = ("auto", "spacy", "espeak")

ZH_INSTALL = "pip install 'chattts-serve[kokoro]'  (misaki with jieba, pypinyin, cn2an)"
EN_INSTALL = (
    "pip install 'chattts-serve[kokoro]' spacy && python -m spacy download en_core_web_sm  (misaki's English), "
    "or pip install 'chattts-serve[kokoro,kokoro-espeak]'  (espeak-ng, GPL-3.0)"
)


class G2PUnavailable(RuntimeError):
    """The G2P a language needs is not installed; the message says what to install."""


class G2P:
    """``G2P(lang)``: ``"z"`` Mandarin (misaki's zh G2P), ``"a"``/``"b"`` American/British English.

    English uses misaki's spaCy G2P when ``en_core_web_sm`` is installed, else misaki's espeak-ng G2P
    (``english="spacy"|"espeak"`` forces one). ``backend`` names the one in use.
    """

    def __init__(self, lang: str = "z", english: str = "auto") -> None:
        code = ALIASES.get(lang.lower(), lang.lower())
        if code not in LANGS:
            raise ValueError(f"lang: {lang!r} is not one of {', '.join(LANGS)} ({', '.join(LANGS.values())})")
        if english not in ENGLISH_BACKENDS:
            raise ValueError(f"english: {english!r} is not one of {', '.join(ENGLISH_BACKENDS)}")
        self.lang = code
        if code == "z":
            self.backend = "misaki-zh"
            self._impl = _build("misaki.zh", ZH_INSTALL, _zh)
            return
        british = code == "b"
        if english == "spacy" or (english == "auto" and en.spacy_available()):
            if not en.spacy_available():
                raise G2PUnavailable(f"English G2P: spaCy's {en.SPACY_MODEL} is not installed. Install: {EN_INSTALL}")
            self.backend = "misaki-en"
            self._impl = _build("misaki.en", EN_INSTALL, lambda: en.SpacyEnG2P(british))
        else:
            if not en.espeak_available():
                missing = ("espeak-ng is not installed" if english == "espeak"
                           else f"neither spaCy's {en.SPACY_MODEL} nor espeak-ng is installed")
                raise G2PUnavailable(f"English G2P: {missing}. Install: {EN_INSTALL}")
            self.backend = "espeak-ng"
            self._impl = _build("misaki.espeak", EN_INSTALL, lambda: en.EspeakEnG2P(british))

    def tokens(self, text: str) -> list[Token]:
        """The words (and punctuation marks) of ``text`` with their phonemes."""
        return self._impl.tokens(text)

    def phonemize(self, text: str) -> str:
        """``text``'s phonemes, unchunked (Chinese: the string the package's zh G2P returns)."""
        return join_phonemes(self.tokens(text))[0]


def _zh():
    from chattts_serve.models.kokoro.text.zh import ZhG2P

    return ZhG2P()


def _build(what: str, install: str, make):
    try:
        return make()
    except ImportError as e:
        raise G2PUnavailable(f"{what} could not be imported ({e}). Install: {install}") from e
