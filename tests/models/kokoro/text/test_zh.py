"""Chinese: our words join to exactly the phonemes and chunks of KPipeline(lang_code="z")."""

from __future__ import annotations

import pytest

from chattts_serve.models.kokoro.text import G2P, chunk_text

from .golden import assert_chunks_match, golden

pytest.importorskip("misaki.zh", reason="needs the [kokoro] extra")

CASES = golden()["zh"]


@pytest.fixture(scope="module")
def g2p():
    return G2P("z")


@pytest.mark.parametrize("case", CASES, ids=[c["text"][:16] for c in CASES])
def test_chunks_match_the_package(g2p, case):
    assert_chunks_match(chunk_text(g2p, case["text"]), case["chunks"])


@pytest.mark.parametrize("case", CASES, ids=[c["text"][:16] for c in CASES])
def test_phonemize_is_misakis_string(g2p, case):
    from misaki.zh import ZHG2P

    for chunk in case["chunks"]:
        assert g2p.phonemize(chunk["graphemes"]) == chunk["untruncated"] == ZHG2P()(chunk["graphemes"])[0]


def test_every_word_knows_its_phonemes(g2p):
    from misaki.zh import ZHG2P

    (chunk,) = chunk_text(g2p, "我今天买了3个苹果，花了12.5元。I love 北京.")
    words = [(t.text, chunk.phonemes[s:e]) for t, (s, e) in zip(chunk.tokens, chunk.spans, strict=True)]
    assert words[:6] == [
        ("我", "wo↓"), ("今天", "ʨi→ntʰjɛ→n"), ("买", "mai↓"), ("了", "lɤ"), ("三个", "sa→nkɤ↘"), ("苹果", "pʰi↗ŋkwo↓")
    ]
    assert ("十二点", "ʂɨ↗ɚ↘tjɛ↓n") in words  # the normalised text the phonemes were made from
    assert [w for w in words if w[0] in (",", ".", "I", "love")] == [
        (",", ","), (".", "."), ("I", "I"), ("love", "love"), (".", ".")
    ]
    for t, (s, e) in zip(chunk.tokens, chunk.spans, strict=True):
        assert chunk.phonemes[s:e] == t.phonemes
        if "\u4e00" <= t.text[0] <= "\u9fff":
            assert t.phonemes == ZHG2P.word2ipa(t.text).replace(chr(815), "")  # legacy_call drops U+032F


def test_blank_text_gives_no_chunks(g2p):
    assert chunk_text(g2p, "  \n\n ") == []
    assert g2p.tokens("") == []
