"""Valid requests whose prompts outgrow a slot (the refine pass's text, the first sentence's voice
sample) get their audio over /v1/tts and /v1/tts/captioned; one that no split fits is a 400 that says
why. An in-process server with a small ``--max-model-len`` stands in for the full model's long prompts."""

from __future__ import annotations

import logging

import httpx
import pytest

from .conftest import HTTP_TIMEOUT, running_server

VOICE = {"text": "今天天气不错。我们去公园。", "min_new_tokens": 100, "max_new_tokens": 100, "seed": 9}
"""Refine on (the default, 40 tokens here to keep it short); each later pass has the voice sample's 100 codes."""
REFINED = {"text": "第一句。第二句。Third one.", "seed": 5, "min_new_tokens": 60, "max_new_tokens": 60}


@pytest.fixture(scope="module")
def http(tiny_ckpt, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("long-prompts")
    flags = ("--max-model-len", "200", "--max-num-seqs", "4")
    with (
        running_server(tiny_ckpt, tmp, *flags, in_process=True) as base,
        httpx.Client(base_url=base, timeout=HTTP_TIMEOUT) as c,
    ):
        yield c


@pytest.mark.parametrize("route", ["/v1/tts", "/v1/tts/captioned"])
@pytest.mark.parametrize(
    ("body", "sentences"),
    [
        ({**VOICE, "refine_max_new_tokens": 40}, 2),
        ({**REFINED, "refine_min_new_tokens": 120, "refine_max_new_tokens": 120}, 3),
    ],
    ids=["voice-sample", "refined"],
)
def test_prompts_longer_than_a_slot_are_spoken(http, caplog, route, body, sentences):
    caplog.set_level(logging.WARNING)
    r = http.post(route, json={**body, "format": "pcm"})
    assert r.status_code == 200, r.text
    if route.endswith("captioned"):  # a sentence spoken in parts is still one segment
        assert len(r.json()["segments"]) == sentences
    else:
        assert len(r.content) > 0
    assert not [x for x in caplog.records if x.levelno >= logging.ERROR], caplog.text


@pytest.mark.parametrize("route", ["/v1/tts", "/v1/tts/captioned"])
def test_a_request_no_slot_holds_is_a_400_that_says_why(http, caplog, route):
    caplog.set_level(logging.WARNING)
    r = http.post(route, json={**REFINED, "min_new_tokens": 300, "max_new_tokens": 300})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "max_model_len of 200 positions" in message and "min_new_tokens 300" in message
    assert not [x for x in caplog.records if x.levelno >= logging.ERROR], caplog.text


@pytest.mark.parametrize("route", ["/v1/tts", "/v1/tts/captioned"])
def test_a_sentence_that_fits_no_slot_after_the_refine_pass_is_a_400(http, caplog, monkeypatch, route):
    """Found only once the refine pass has run (the fitter patched to find no split, unrefined included):
    the client's error, a 400 ``input_too_long``, never a 500 or an ERROR line."""
    from chattts_serve.engine import pipeline

    caplog.set_level(logging.INFO)
    monkeypatch.setattr(pipeline, "fit", lambda *a, **kw: None)
    r = http.post(route, json={**REFINED, "refine_max_new_tokens": 4, "format": "pcm"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "input_too_long" and "does not fit a slot" in r.json()["error"]["message"]
    assert not [x for x in caplog.records if x.levelno >= logging.ERROR], caplog.text
