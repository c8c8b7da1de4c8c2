"""The front-end against kokoro==0.9.4 / misaki==0.9.4 run live (not from the golden file).

Runs when CHATTTS_REFERENCE_PYTHON points at the python of the reference environment
(``bash ../shared/oracle/setup_venv.sh .venv-reference``): scripts/kokoro_text_goldens.py --oracle
answers there, in a subprocess.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from chattts_serve.models.kokoro.text import G2P, Token, chunk_text, word_timestamps
from chattts_serve.models.kokoro.text.chunking import split_tokens
from chattts_serve.models.kokoro.text.en import espeak_available
from chattts_serve.models.kokoro.text.tokens import make_chunk

from .golden import assert_chunks_match, golden

REFERENCE_PYTHON = os.environ.get("CHATTTS_REFERENCE_PYTHON")

pytestmark = [
    pytest.mark.reference,
    pytest.mark.skipif(not REFERENCE_PYTHON, reason="set CHATTTS_REFERENCE_PYTHON to a reference environment"),
    pytest.mark.skipif(not espeak_available(), reason="needs the [kokoro,kokoro-espeak] extras"),
]


def _script():
    path = Path(__file__).resolve().parents[4] / "scripts" / "kokoro_text_goldens.py"
    spec = importlib.util.spec_from_file_location("kokoro_text_goldens", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def live():
    script = _script()
    join, tokens = script.join_cases(seed=7), script.token_cases()  # other durations than the goldens'
    request = {"zh": script.ZH_TEXTS, "espeak": {"en-us": script.EN_TEXTS}, "join": join, "en_tokenize": tokens}
    return script, request, script.ask(REFERENCE_PYTHON, request, timeout=300)


def test_chinese_chunks_live(live):
    script, _, answer = live
    g2p = G2P("z")
    for text, theirs in zip(script.ZH_TEXTS, answer["zh"], strict=True):
        assert_chunks_match(chunk_text(g2p, text), theirs)
    assert answer["zh"] == [c["chunks"] for c in golden()["zh"]]  # and the goldens are still the package's


def test_english_live(live):
    script, request, answer = live
    g2p = G2P("a", english="espeak")
    assert [g2p.phonemize(t) for t in script.EN_TEXTS] == answer["espeak"]["en-us"]
    for tks, chunks in zip(request["en_tokenize"], answer["en_tokenize"], strict=True):
        ours = [make_chunk(g) for g in split_tokens([Token(t, p, " " if w else "", w) for t, p, w in tks])]
        assert [[c.text, c.phonemes, len(c.tokens)] for c in ours] == chunks


def test_word_times_live(live):
    _, request, answer = live
    for case, times in zip(request["join"], answer["join"], strict=True):
        tokens = [Token(t, p, " " if w else "", w) for t, p, w in case["tokens"]]
        ours = word_timestamps(make_chunk(tokens), case["durations"], 600, 24000)
        assert ours == [(t[0], *ts) for t, ts in zip(case["tokens"], times, strict=True) if t[1]]
