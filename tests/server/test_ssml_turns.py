"""server/ssml_turns.py: SSML ``<voice>`` on ``POST /v1/audio/speech``, ``/v1/tts`` and ``/v1/tts/captioned`` is a
dialogue, the audio of the corresponding ``/v1/dialogue`` request byte for byte (streamed, whole, SSE, captioned),
its turns run side by side; one voice run is the ordinary request in its voice; voices resolve as any voice field
(tenants included); faults are 400s naming their place.

The byte-for-byte comparisons run on a server with one KV slot. With more, two turns of one length decode their
audio windows in one batch when they run in step, and whether they do depends on timing: a batched window may
round a sample differently (by one LSB) from the same window alone. (The engine's batch invariance covers the codes,
``engine.py``; ``/v1/dialogue``'s own tests compare turns of different lengths, whose windows never batch.)"""

from __future__ import annotations

import base64
import json

import httpx
import pytest
from openai import OpenAI

from chattts_serve.sampling_params import speed_prompt
from chattts_serve.server.protocol import MAX_TURNS
from chattts_serve.server.ssml_turns import TURN_PAUSE_MS

from .conftest import (
    HTTP_TIMEOUT,
    SR,
    app_config,
    check_openai_error,
    expected_samples,
    metric,
    metrics_text,
    running_server,
    wait_until,
)

TOKENS = 24
OPTIONS = {"seed": 7, "refine_text": False, "min_new_tokens": TOKENS, "max_new_tokens": TOKENS}
FIRST, SECOND = "今天天气真不错。", "是啊，我们去公园吧。"
TWO_VOICES = f'<speak>{FIRST}\n  <voice name="nova">{SECOND}</voice>\n</speak>'
"""Two turns: the first in the request's voice (alloy below), the second in nova's."""


@pytest.fixture(scope="module")
def serial(tiny_ckpt, tmp_path_factory):
    """A server with one KV slot: every window decodes alone, so equal requests are equal bytes."""
    tmp = tmp_path_factory.mktemp("ssml-turns")
    with running_server(tiny_ckpt, tmp, "--max-num-seqs", "1", in_process=True) as base:
        yield base


@pytest.fixture(scope="module")
def http(serial):
    with httpx.Client(base_url=serial, timeout=HTTP_TIMEOUT) as c:
        yield c


def _dialogue(http, *turns: tuple) -> bytes:
    """The /v1/dialogue audio (pcm) of (voice, text[, options]) turns, each with OPTIONS (the same seed)."""
    body = {
        "turns": [{"voice": t[0], "text": t[1], **OPTIONS, **(t[2] if len(t) > 2 else {})} for t in turns],
        "format": "pcm",
        "stream": False,
        "pause_ms": TURN_PAUSE_MS,
    }
    r = http.post("/v1/dialogue", json=body)
    assert r.status_code == 200, r.text
    return r.content


def _tts(http, text: str, voice: str = "alloy", **extra) -> bytes:
    r = http.post("/v1/tts", json={"text": text, "voice": voice, "format": "pcm", "stream": False, **OPTIONS, **extra})
    assert r.status_code == 200, r.text
    return r.content


@pytest.fixture(scope="module")
def expected(http) -> bytes:
    audio = _dialogue(http, ("alloy", FIRST), ("nova", SECOND))
    pause = b"\0\0" * (SR * TURN_PAUSE_MS // 1000)
    assert audio == _tts(http, FIRST) + pause + _tts(http, SECOND, "nova")  # two voices, in order, a pause between
    return audio


@pytest.mark.parametrize("stream", [False, True])
def test_native_two_voices_are_the_dialogues_audio(http, expected, stream):
    body = {"text": TWO_VOICES, "voice": "alloy", "format": "pcm", "stream": stream, **OPTIONS}
    r = http.post("/v1/tts", json=body)
    assert r.status_code == 200, r.text
    assert r.content == expected
    assert r.content != _tts(http, FIRST + SECOND)  # not one voice reading it all


def test_the_openai_sdk_speaks_two_voices_as_the_dialogue(serial, expected):
    with OpenAI(base_url=f"{serial}/v1", api_key="x", timeout=HTTP_TIMEOUT, max_retries=0) as client:
        whole = client.audio.speech.create(
            model="tts-1", voice="alloy", input=TWO_VOICES, response_format="pcm", extra_body=OPTIONS
        )
        assert whole.content == expected
        with client.audio.speech.with_streaming_response.create(
            model="tts-1", voice="alloy", input=TWO_VOICES, response_format="pcm", extra_body=OPTIONS
        ) as resp:
            assert b"".join(resp.iter_bytes()) == expected
        with client.audio.speech.with_streaming_response.create(
            model="tts-1",
            voice="alloy",
            input=TWO_VOICES,
            response_format="pcm",
            stream_format="sse",
            extra_body={**OPTIONS, "timestamps": True},
        ) as resp:
            raw = resp.read().decode()
    events = [json.loads(block[len("data: ") :]) for block in raw.split("\n\n") if block.strip()]
    assert events[-1]["type"] == "speech.audio.done"
    deltas = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    assert deltas == expected
    # each turn's sentence where its audio is: the second after the first and the pause
    segments = [(e["text"], e["start_s"], e["end_s"]) for e in events if e["type"] == "speech.segment"]
    one, pause = expected_samples(TOKENS), SR * TURN_PAUSE_MS // 1000
    assert segments == [(FIRST, 0.0, one / SR), (SECOND, (one + pause) / SR, (2 * one + pause) / SR)]


def test_captioned_two_voices(http, expected):
    body = {"text": TWO_VOICES, "voice": "alloy", "format": "pcm", **OPTIONS}
    r = http.post("/v1/tts/captioned", json=body)
    assert r.status_code == 200, r.text
    doc = r.json()
    assert base64.b64decode(doc["audio"]) == expected
    assert [s["text"] for s in doc["segments"]] == [FIRST, SECOND] and [s["index"] for s in doc["segments"]] == [0, 1]


def test_three_turns_nested_and_the_requests_voice_again(http):
    ssml = f'<speak><voice name="nova">{FIRST}<voice name="echo">{SECOND}</voice>好的。</voice>走吧。</speak>'
    r = http.post("/v1/tts", json={"text": ssml, "voice": "alloy", "format": "pcm", "stream": False, **OPTIONS})
    assert r.status_code == 200, r.text
    turns = [("nova", FIRST), ("echo", SECOND), ("nova", "好的。"), ("alloy", "走吧。")]
    assert r.content == _dialogue(http, *turns)


def test_the_turns_run_side_by_side_as_one_request(server):
    """On the shared server (several KV slots): every turn holds a slot while the first one's audio is out; the
    document is one request to the limits; a client that leaves aborts every turn."""
    long = {**OPTIONS, "min_new_tokens": 2000, "max_new_tokens": 2000}
    quick = {"first_chunk": 1, "max_chunk": 32, "left_context": 4, "lookahead": 1, "crossfade": 0}
    ssml = f'<speak>{FIRST}<voice name="nova">{SECOND}</voice><voice name="echo">好的。</voice></speak>'
    body = {"text": ssml, "voice": "alloy", "format": "pcm", "chunking": quick, **long}
    with httpx.Client(timeout=HTTP_TIMEOUT) as c:
        with c.stream("POST", server + "/v1/tts", json=body) as r:
            assert r.status_code == 200
            chunks = r.iter_raw()  # keep a reference: a dropped iterator closes the connection
            assert len(next(chunks)) > 0
            assert wait_until(lambda: metric(server, "chattts_kv_slots_used") == 3, timeout=30), metrics_text(server)
            assert metric(server, "chattts_requests_in_flight") == 1
    assert wait_until(lambda: metric(server, "chattts_kv_slots_used") == 0, timeout=30), metrics_text(server)
    assert metric(server, "chattts_requests_in_flight") == 0


def test_each_turn_keeps_the_elements_around_it(http):
    """A <prosody> around both voices is each turn's rate; each turn may have its own."""
    ssml = f'<speak><prosody rate="slow">{FIRST}<voice name="nova"><prosody rate="+50%">{SECOND}</prosody></voice>'
    ssml += "</prosody></speak>"
    r = http.post("/v1/tts", json={"text": ssml, "voice": "alloy", "format": "pcm", "stream": False, **OPTIONS})
    assert r.status_code == 200, r.text
    slow, faster = {"prompt": speed_prompt(0.75)}, {"prompt": speed_prompt(0.75 * 1.5)}
    assert r.content == _dialogue(http, ("alloy", FIRST, slow), ("nova", SECOND, faster))
    assert r.content != _dialogue(http, ("alloy", FIRST, slow), ("nova", SECOND, slow))


@pytest.mark.parametrize("voice", ["nova", "alloy(2)+nova(1)"])
def test_one_run_is_the_ordinary_request_in_its_voice(http, voice):
    ssml = f'<speak> <voice name="{voice}">{FIRST}</voice> </speak>'
    assert _tts(http, ssml) == _tts(http, FIRST, voice)
    r = http.post(
        "/v1/audio/speech",
        json={"model": "tts-1", "voice": "alloy", "input": ssml, "response_format": "pcm", **OPTIONS},
    )
    assert r.status_code == 200 and r.content == _tts(http, FIRST, voice)


def test_a_saved_voice_and_a_speaker_string_by_name(http):
    r = http.post("/v1/voices", json={"name": "ssml-turns-saved", "seed": 5})
    assert r.status_code == 201, r.text
    speaker = r.json()["speaker"]
    for name in ("ssml-turns-saved", speaker):
        ssml = f'<speak>{FIRST}<voice name="{name}">{SECOND}</voice></speak>'
        assert _tts(http, ssml) == _dialogue(http, ("alloy", FIRST), ("ssml-turns-saved", SECOND))


NOBODY = f'<speak>{FIRST}\n<voice name="nobody">{SECOND}</voice></speak>'
ALTERNATING = "<speak>" + "".join(f'<voice name="{v}">好。</voice>' for v in ["nova", "echo"] * 17) + "</speak>"


@pytest.mark.parametrize(
    "text, code, words",
    [
        (
            f'<speak>{FIRST}\n<voice name="nobody">{SECOND}</voice></speak>',
            "unknown_voice",
            ["line 2, column 1", "nobody"],
        ),
        (f'<speak>{FIRST}<voice name="nova(0)+alloy">好</voice></speak>', "invalid_blend", ["<voice> at", "nova(0)"]),
        (f"<speak>{FIRST}<voice>{SECOND}</voice></speak>", None, ["<voice> at line 1, column 16: name is required"]),
        (
            f'<speak><voice name="nova">{FIRST}</speak>',
            None,
            ["mismatched tag", "inside <voice> from line 1, column 8"],
        ),
        ('<speak><say-as interpret-as="digits"><voice name="nova">1</voice></say-as></speak>', None, ["text only"]),
        (f'<speak>{FIRST}<voice name="nova"><audio/></voice></speak>', None, ["unknown SSML tag <audio>"]),
        (
            "<speak>" + "".join(f'<voice name="{v}">好。</voice>' for v in ["nova", "echo"] * 17) + "</speak>",
            None,
            ["34"],
        ),
    ],
)
def test_bad_voices_are_400s_naming_them(http, text, code, words):
    for path, field, body in (
        ("/v1/tts", "text", {"text": text, "format": "pcm"}),
        ("/v1/audio/speech", "input", {"model": "tts-1", "voice": "alloy", "input": text, "response_format": "pcm"}),
    ):
        err = check_openai_error(http.post(path, json={**body, **OPTIONS}), 400)
        assert err["param"] == field and err["code"] == code, err
        for word in words:
            assert word in err["message"], err
    assert MAX_TURNS < 34


def test_a_turn_the_engine_refuses_is_named(http):
    """A turn with nothing to say after normalisation is found when it is submitted: a 400 naming it."""
    err = check_openai_error(
        http.post("/v1/tts", json={"text": f'<speak>{FIRST}<voice name="nova">①</voice></speak>', **OPTIONS}), 400
    )
    assert err["param"] == "text", err
    assert err["message"].startswith("SSML turn 1 (<voice> at line 1, column 16): nothing to speak"), err


def test_voices_are_the_tenants_own(tiny_ckpt, tmp_path):
    """A saved voice in <voice> is looked up among the request's tenant's voices, as in any voice field."""
    from starlette.testclient import TestClient

    from chattts_serve.engine.async_engine import AsyncEngine
    from chattts_serve.engine.config import EngineConfig
    from chattts_serve.server.app import create_app
    from chattts_serve.server.auth import KeyRing

    engine = AsyncEngine.from_pretrained(tiny_ckpt, "cpu", EngineConfig.with_slots(1))  # (the module's docstring)
    keys = KeyRing.from_tenants({"a": ("ka",), "b": ("kb",)})
    a, b = {"Authorization": "Bearer ka"}, {"Authorization": "Bearer kb"}
    ssml = f'<speak>{FIRST}<voice name="mine">{SECOND}</voice></speak>'
    body = {"text": ssml, "voice": "alloy", "format": "pcm", "stream": False, **OPTIONS}
    with TestClient(create_app(app_config(tiny_ckpt, tmp_path), engine=engine, keys=keys)) as c:
        assert c.post("/v1/voices", json={"name": "mine", "seed": 5}, headers=a).status_code == 201
        r = c.post("/v1/tts", json=body, headers=a)
        assert r.status_code == 200, r.text
        assert r.content == _dialogue_with(c, a, ("alloy", FIRST), ("mine", SECOND))
        err = check_openai_error(c.post("/v1/tts", json=body, headers=b), 400)
        assert err["code"] == "unknown_voice" and "'mine'" in err["message"], err


def _dialogue_with(client, headers, *turns) -> bytes:
    body = {"turns": [{"voice": v, "text": t, **OPTIONS} for v, t in turns], "format": "pcm", "stream": False}
    r = client.post("/v1/dialogue", json={**body, "pause_ms": TURN_PAUSE_MS}, headers=headers)
    assert r.status_code == 200, r.text
    return r.content


def test_ssml_at_several_rates_is_each_run_at_its_rate(http):
    """``<prosody rate>`` on part of a document: the slow run is spoken as a request with its ``[speed_N]`` would
    be, and the document's audio is the runs' audio joined (seeded; one slot, so every window decodes alone; no
    first-sentence voice, so each run is exactly its own request)."""
    mixed = '<speak>你好<break time="500ms"/>世界。<prosody rate="slow">慢一点。</prosody></speak>'
    opts = {"first_sentence_voice": False}
    audio = _tts(http, mixed, **opts)
    assert audio == _tts(http, "你好[lbreak]世界。", **opts) + _tts(http, "慢一点。", prompt=speed_prompt(0.75), **opts)
    assert audio != _tts(http, "你好[lbreak]世界。慢一点。", **opts)
    body = {"model": "tts-1", "input": mixed, "voice": "alloy", "response_format": "pcm"}
    r = http.post("/v1/audio/speech", json=body)
    assert r.status_code == 200 and r.content, r.text
