"""VitsTokenizer: the ids transformers' VitsTokenizer makes (golden ids are in test_golden.py); options and
errors here."""

from __future__ import annotations

import json
import sys

import pytest

from chattts_serve.models.vits.random_checkpoint import MMS_ENG_VOCAB
from chattts_serve.models.vits.tokenizer import TokenizerError, VitsTokenizer, _uroman


def _tok(**kw) -> VitsTokenizer:
    settings = dict(vocab=MMS_ENG_VOCAB, add_blank=True, normalize=True, phonemize=False, pad_token="k",
                    unk_token="<unk>", added_tokens={"<unk>": 38})
    settings.update(kw)
    return VitsTokenizer(**settings)


def test_from_dir_reads_the_hub_files(vits_tiny, vits_tokenizer):
    t = vits_tokenizer
    assert (t.add_blank, t.normalize, t.phonemize, t.is_uroman, t.language) == (True, True, False, False, "eng")
    assert (t.pad_token, t.unk_token, t.unk_id) == ("k", "<unk>", 38)
    assert t.encode("Hi!") == [0, 6, 0, 18, 0]


def test_lowercases_drops_outside_the_vocab_and_interleaves_blanks():
    assert _tok().encode("Hé, Ö!") == [0, 6, 0]  # "é", ",", "ö", "!" dropped, then the space stripped
    assert _tok().encode("Hé, Ö! a") == [0, 6, 0, 19, 0, 19, 0, 26, 0]
    assert _tok(add_blank=False).encode("Hi there") == [6, 18, 19, 33, 6, 7, 25, 7]


def test_the_pad_token_splits_the_text_as_transformers_does():
    # "k" is MMS English's pad token and a letter: a special token, emitted alone, without blanks around it.
    assert _tok().encode("kid") == [0, 0, 18, 0, 5, 0]
    assert _tok().encode("kk") == [0, 0]


def test_without_normalize_unknown_characters_are_the_unk_id():
    assert _tok(normalize=False).encode("Hi") == [0, 38, 0, 18, 0]


def test_romanian_comma_below_becomes_cedilla():
    vocab = {"_": 0, "ţ": 1, "a": 2}
    assert VitsTokenizer(vocab=vocab, phonemize=False, language="ron").encode("ța") == [0, 1, 0, 2, 0]
    assert VitsTokenizer(vocab=vocab, phonemize=False).encode("ța") == [0, 2, 0]


@pytest.fixture
def no_cached_uroman():
    _uroman.cache_clear()
    yield
    _uroman.cache_clear()


def test_uroman_missing_is_a_clear_error(monkeypatch, no_cached_uroman):
    monkeypatch.setitem(sys.modules, "uroman", None)  # import uroman -> ImportError
    t = _tok(is_uroman=True)
    assert t.encode("hello") == t.encode("hello")  # ASCII text needs no romaniser
    with pytest.raises(TokenizerError, match=r"uroman.*chattts-serve\[vits-uroman\]"):
        t.encode("привет")


def test_uroman_is_used_when_the_checkpoint_asks(monkeypatch, no_cached_uroman):
    class Fake:
        class Uroman:
            def romanize_string(self, text):
                return "privet"

    monkeypatch.setitem(sys.modules, "uroman", Fake)
    assert _tok(is_uroman=True).encode("привет") == _tok().encode("privet")


def test_phonemize_missing_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "phonemizer", None)
    with pytest.raises(TokenizerError, match="phonemizer"):
        _tok(phonemize=True).encode("hello")


def test_missing_or_malformed_files(tmp_path):
    with pytest.raises(TokenizerError, match="no vocab.json"):
        VitsTokenizer.from_dir(tmp_path)
    (tmp_path / "vocab.json").write_text(json.dumps({"a": "1"}))
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(TokenizerError, match="token -> integer id"):
        VitsTokenizer.from_dir(tmp_path)


def test_defaults_follow_transformers(tmp_path):
    """A tokenizer_config.json without the options takes transformers' defaults (phonemize: true), and the
    special tokens missing from the vocabulary get the ids transformers 5.24 gives them (checked there)."""
    (tmp_path / "vocab.json").write_text(json.dumps({"_": 0, "a": 1}))
    (tmp_path / "tokenizer_config.json").write_text("{}")
    t = VitsTokenizer.from_dir(tmp_path)
    assert (t.add_blank, t.normalize, t.phonemize, t.is_uroman) == (True, True, True, False)
    assert (t.pad_token, t.unk_token) == ("<pad>", "<unk>")
    assert t.added_tokens == {"<unk>": 2, "<pad>": 3}
