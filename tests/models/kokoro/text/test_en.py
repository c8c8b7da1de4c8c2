"""English: misaki's espeak-ng G2P (spaCy's model is not installed here), words recovered."""

from __future__ import annotations

import pytest

from chattts_serve.models.kokoro.text import G2P, G2PUnavailable, Token
from chattts_serve.models.kokoro.text import en as en_mod
from chattts_serve.models.kokoro.text.en import split_marks, tokens_from_misaki

from .golden import golden

ESPEAK = golden()["espeak"]
needs_espeak = pytest.mark.skipif(not en_mod.espeak_available(), reason="needs the [kokoro-espeak] extra")


@needs_espeak
@pytest.mark.parametrize(("lang", "code"), [("a", "en-us"), ("b", "en-gb")])
def test_espeak_phonemes_are_misakis(lang, code):
    g2p = G2P(lang, english="espeak")
    assert g2p.backend == "espeak-ng"
    for case in ESPEAK[code]:
        assert g2p.phonemize(case["text"]) == case["phonemes"]


@needs_espeak
def test_espeak_words_carry_their_own_phonemes():
    tokens = G2P("a", english="espeak").tokens('Dr. Smith paid $42! (Really?)')
    assert [(t.text, t.phonemes, t.space) for t in tokens] == [
        ("Dr", "dˈɑːktɚ", ""), (".", ".", " "), ("Smith", "smˈɪθ", " "), ("paid", "pˈAd", " "),
        ("$42", "dˈɑːlɚ fˈɔːɹɾi tˈuː", ""), ("!", "!", " "),
        ("(", "(", ""), ("Really", "ɹˈiəli", ""), ("?", "?", ""), (")", ")", ""),
    ]


def test_auto_picks_espeak_without_spacys_model(monkeypatch):
    monkeypatch.setattr(en_mod, "spacy_available", lambda: False)
    monkeypatch.setattr(en_mod, "espeak_available", lambda: True)
    monkeypatch.setattr(en_mod, "EspeakEnG2P", lambda british: ("espeak", british))
    g2p = G2P("b")
    assert (g2p.backend, g2p._impl) == ("espeak-ng", ("espeak", True))


def test_auto_picks_spacy_when_its_model_is_installed(monkeypatch):
    monkeypatch.setattr(en_mod, "spacy_available", lambda: True)
    monkeypatch.setattr(en_mod, "SpacyEnG2P", lambda british: ("spacy", british))
    g2p = G2P("en-us")
    assert (g2p.lang, g2p.backend, g2p._impl) == ("a", "misaki-en", ("spacy", False))


def test_no_english_g2p_says_what_to_install(monkeypatch):
    monkeypatch.setattr(en_mod, "spacy_available", lambda: False)
    monkeypatch.setattr(en_mod, "espeak_available", lambda: False)
    with pytest.raises(G2PUnavailable, match=r"en_core_web_sm.*kokoro-espeak.*GPL"):
        G2P("a")
    with pytest.raises(G2PUnavailable, match="spacy download en_core_web_sm"):
        G2P("a", english="spacy")
    with pytest.raises(G2PUnavailable, match="English G2P: espeak-ng is not installed"):
        G2P("a", english="espeak")


def test_no_chinese_g2p_says_what_to_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "misaki.zh", None)  # as if misaki were not installed
    monkeypatch.delitem(sys.modules, "chattts_serve.models.kokoro.text.zh", raising=False)
    with pytest.raises(G2PUnavailable, match=r"chattts-serve\[kokoro\]"):
        G2P("z")


def test_bad_options_are_named():
    with pytest.raises(ValueError, match="lang: 'j'"):
        G2P("j")
    with pytest.raises(ValueError, match="english: 'x'"):
        G2P("a", english="x")


def test_misaki_tokens_read_as_en_tokenize_reads_them():
    from misaki.token import MToken

    mtokens = [MToken("Hello", "UH", "", "həlˈO"), MToken(",", ",", " ", ","), MToken("Zq", "NN", "", None)]
    assert tokens_from_misaki(mtokens) == [
        Token("Hello", "həlˈO", "", ""), Token(",", ",", " ", " "), Token("Zq", "", "", "")
    ]


def test_split_marks_only_where_both_sides_carry_them():
    assert split_marks('"Yes."', '"jˈɛs."', " ") == [
        Token('"', '"'), Token("Yes", "jˈɛs"), Token(".", "."), Token('"', '"', " ", " ")
    ]
    assert split_marks("$42", "dˈɑːlɚ", "") == [Token("$42", "dˈɑːlɚ")]
    assert split_marks("...", "...", "") == [Token(".", "."), Token(".", "."), Token(".", ".")]


class _FakeEspeak:
    """misaki's EspeakG2P's surface: a whole-text call, and the backend's per-item call."""

    def __init__(self, whole: dict[str, str], alone: dict[str, str]):
        self.whole, self.alone = whole, alone
        self.backend = self

    def __call__(self, text):
        return (self.whole.get(text) or self.alone[text]), None

    def phonemize(self, texts):
        return [self.alone[t] for t in texts]


def _espeak(fake) -> en_mod.EspeakEnG2P:
    g2p = en_mod.EspeakEnG2P.__new__(en_mod.EspeakEnG2P)
    g2p._g2p = fake
    return g2p


def test_espeak_words_are_grouped_by_their_own_counts():
    fake = _FakeEspeak({"paid $42 now.": "pˈAd dˈɑːlɚ fˈɔːɹɾi tˈuː nˈW."},
                       {"paid": "pˈAd", "$42": "dˈɑːlɚz fˈɔːɹti tuː", "now.": "nˈW."})
    tokens = _espeak(fake).tokens("paid $42 now.")
    # the line's own phonemes (context-dependent), grouped 1 + 3 + 1 as the words alone read
    assert [(t.text, t.phonemes) for t in tokens] == [
        ("paid", "pˈAd"), ("$42", "dˈɑːlɚ fˈɔːɹɾi tˈuː"), ("now", "nˈW"), (".", ".")
    ]


def test_espeak_words_fall_back_to_their_own_phonemes_when_counts_disagree():
    fake = _FakeEspeak({"a b": "ɐbˈiː"}, {"a": "ɐ", "b": "bˈiː"})  # read across the two words
    assert [(t.text, t.phonemes, t.space) for t in _espeak(fake).tokens("a b")] == [("a", "ɐ", " "), ("b", "bˈiː", "")]


def test_the_front_end_imports_without_misaki():
    """The server imports it whatever is installed: misaki and its dependencies load only in ``G2P()``."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "for name in ('misaki', 'jieba', 'pypinyin', 'cn2an', 'phonemizer', 'espeakng_loader'):\n"
        "    sys.modules[name] = None  # any import of them now fails\n"
        "from chattts_serve.models.kokoro.text import G2P, G2PUnavailable, phonemes_to_ids\n"
        "assert phonemes_to_ids('ab', {'a': 43, 'b': 44}) == [0, 43, 44, 0]\n"
        "try:\n"
        "    G2P('z')\n"
        "except G2PUnavailable as e:\n"
        "    print(e)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert "chattts-serve[kokoro]" in done.stdout
