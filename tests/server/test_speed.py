"""``speed`` with ``speed_mode`` (audio/stretch.py) through the server: the OpenAI SDK and the native API."""

from __future__ import annotations

import base64
import contextlib
import json

import numpy as np
import pytest
from openai import OpenAI
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from chattts_serve.audio.stretch import stretch
from chattts_serve.sampling_params import speed_prompt

from .conftest import HTTP_TIMEOUT, SR, check_openai_error, decode_audio, expected_samples, tts_body, ws_url

TOKENS = 40
EXPECTED = expected_samples(TOKENS)
TEXT = "今天天气真不错。"
FIXED = {"seed": 1, "min_new_tokens": TOKENS, "max_new_tokens": TOKENS, "refine_text": False}


@pytest.fixture(scope="module")
def client(server):
    with OpenAI(base_url=f"{server}/v1", api_key="x", timeout=60, max_retries=0) as c:
        yield c


def _speech(client, fmt: str = "pcm", speed: float = 1.0, **extra) -> bytes:
    return client.audio.speech.create(
        model="tts-1", voice="alloy", input=TEXT, response_format=fmt, speed=speed, extra_body={**FIXED, **extra}
    ).content


def _rms(pcm: np.ndarray) -> float:
    return float(np.sqrt(np.mean((pcm / 32768.0) ** 2)))


def test_stretch_shortens_the_audio_by_the_speed(client):
    """``speed=1.5`` stretched: the same codes as at speed 1 (the prompt is left alone), so exactly
    ``round(n / 1.5)`` samples, at the same level."""
    plain, _ = decode_audio(_speech(client), "pcm")
    fast, _ = decode_audio(_speech(client, speed=1.5, speed_mode="stretch"), "pcm")
    slow, _ = decode_audio(_speech(client, speed=0.5, speed_mode="stretch"), "pcm")
    assert len(plain) == EXPECTED
    assert len(fast) == round(EXPECTED / 1.5)
    assert len(slow) == round(EXPECTED / 0.5)
    assert _rms(fast) == pytest.approx(_rms(plain), rel=0.25)


def test_prompt_mode_is_todays_behaviour(client):
    """The default ("prompt") is what ``speed`` always did: the [speed_N] prompt, nothing else; the same
    bytes with the mode named, left out, or as the prompt itself."""
    default = _speech(client, speed=1.5)
    assert _speech(client, speed=1.5, speed_mode="prompt") == default
    assert _speech(client, prompt=speed_prompt(1.5)) == default


def test_both_is_the_prompt_then_the_stretch(client):
    both, _ = decode_audio(_speech(client, speed=2.0, speed_mode="both"), "pcm")
    prompted, _ = decode_audio(_speech(client, speed=2.0), "pcm")
    assert len(both) == round(len(prompted) / 2.0)


@pytest.mark.parametrize(("fmt", "rate"), [("mp3", None), ("opus", None), ("flac", None), ("wav", 8000)])
def test_stretch_in_other_formats(client, fmt, rate):
    """It sits before the resampler and the encoder: every format, every rate, one valid stream."""
    extra = {"sample_rate": rate} if rate else {}
    samples, got_rate = decode_audio(_speech(client, fmt, speed=2.0, speed_mode="stretch", **extra), fmt)
    seconds = len(samples) / got_rate
    assert seconds == pytest.approx(EXPECTED / SR / 2.0, abs=0.1)  # (codec priming and frames: ~50 ms)


def test_sse_stream_is_stretched(client):
    with client.audio.speech.with_streaming_response.create(
        model="tts-1",
        voice="alloy",
        input=TEXT,
        response_format="pcm",
        speed=1.5,
        stream_format="sse",
        extra_body={**FIXED, "speed_mode": "stretch"},
    ) as resp:
        raw = resp.read().decode()
    audio = b"".join(
        base64.b64decode(e["audio"])
        for e in (json.loads(b[len("data: ") :]) for b in raw.split("\n\n") if b.strip())
        if e["type"] == "speech.audio.delta"
    )
    assert len(audio) // 2 == round(EXPECTED / 1.5)


def test_native_tts_takes_speed_and_mode(http):
    """/v1/tts: streamed (chunk by chunk) and whole (one shot) give the same stretched samples."""
    body = tts_body(TOKENS, speed=2.0, speed_mode="stretch")
    streamed = http.post("/v1/tts", json=body)
    whole = http.post("/v1/tts", json={**body, "stream": False})
    assert streamed.status_code == whole.status_code == 200
    assert len(streamed.content) // 2 == round(EXPECTED / 2.0)
    assert streamed.content == whole.content
    prompt_mode = http.post("/v1/tts", json=tts_body(TOKENS, speed=2.0)).content
    assert prompt_mode == http.post("/v1/tts", json=tts_body(TOKENS, prompt=speed_prompt(2.0))).content


RATES = '<speak>快一点。<prosody rate="slow">慢一点。</prosody></speak>'
"""Two runs, the second at "slow" (0.75): with speed_mode "stretch", its audio alone is stretched."""


def test_stretch_gives_each_ssml_rate_run_its_own_factor(http):
    """speed_mode "stretch" on SSML at two rates: the unmarked run's audio is the model's, sample for sample;
    the slow run's is stretched by 0.75 (the same codes: the prompt is left alone), to exactly its length
    / 0.75; streamed and whole give the same bytes."""
    seg = expected_samples(TOKENS)
    body = tts_body(TOKENS, RATES, speed_mode="stretch")
    streamed = http.post("/v1/tts", json=body)
    whole = http.post("/v1/tts", json={**body, "stream": False})
    assert streamed.status_code == whole.status_code == 200, streamed.text
    assert streamed.content == whole.content
    plain = http.post("/v1/tts", json=tts_body(TOKENS, "<speak>快一点。慢一点。</speak>"))  # unstretched, same prompt
    ref, out = np.frombuffer(plain.content, "<i2"), np.frombuffer(streamed.content, "<i2")
    assert len(ref) == 2 * seg
    assert len(out) == seg + round(seg / 0.75)
    assert np.abs(out[:seg].astype(np.int32) - ref[:seg]).max() <= 16  # (a request's batch may move an LSB)
    slowed = stretch(ref[seg:].astype(np.float32) / 32768, 0.75, SR)
    assert np.corrcoef(out[seg:] / 32768, slowed)[0, 1] > 0.95
    # "prompt" (the default) is as before: each run's [speed_N], nothing stretched
    prompted = http.post("/v1/tts", json=tts_body(TOKENS, RATES)).content
    assert len(prompted) // 2 == 2 * seg and prompted != plain.content


def test_stretch_follows_the_rate_of_each_voice_turn(http):
    """SSML that changes voice (a dialogue's turns) in "stretch" mode: each turn's runs at their own factor,
    the pause between turns at the request's (1: as it is)."""
    seg = expected_samples(TOKENS)
    doc = '<speak>快一点。<voice name="nova"><prosody rate="x-slow">慢一点。</prosody></voice></speak>'
    got = http.post("/v1/tts", json=tts_body(TOKENS, doc, speed_mode="stretch"))
    plain = http.post("/v1/tts", json=tts_body(TOKENS, '<speak>快一点。<voice name="nova">慢一点。</voice></speak>'))
    assert got.status_code == plain.status_code == 200, got.text
    pause = len(plain.content) // 2 - 2 * seg
    assert pause > 0 and len(got.content) // 2 == seg + pause + round(seg / 0.5)
    # the turns run side by side in the engine: their batch may differ by a step, and the samples by an LSB
    first, same = np.frombuffer(got.content, "<i2")[: seg + pause], np.frombuffer(plain.content, "<i2")[: seg + pause]
    assert np.abs(first.astype(np.int32) - same).max() <= 16


def _ws_pcm(server, start: dict) -> tuple[bytes, dict]:
    """The PCM of one WebSocket part, and its last event."""
    pcm = b""
    with connect(ws_url(server), open_timeout=10, close_timeout=5) as ws:
        ws.send(json.dumps({"type": "start", **start}))
        with contextlib.suppress(ConnectionClosed):  # a refused start may close the session before this
            ws.send(json.dumps({"type": "end"}))
        while True:
            event = json.loads(ws.recv(timeout=HTTP_TIMEOUT))
            if event["type"] == "chunk" and event["bytes"]:
                pcm += ws.recv(timeout=HTTP_TIMEOUT)
            elif event["type"] in ("end", "error"):
                return pcm, event


def test_websocket_takes_speed_and_mode(server, http):
    """The WebSocket's start message takes the native options: the same stretched samples as /v1/tts."""
    body = tts_body(TOKENS, speed=1.5, speed_mode="stretch")
    pcm, last = _ws_pcm(server, body)
    assert last["type"] == "end"
    assert len(pcm) // 2 == round(EXPECTED / 1.5)
    assert pcm == http.post("/v1/tts", json=body).content
    _, last = _ws_pcm(server, {**body, "timestamps": True})  # timings of stretched audio would be estimates
    assert last["type"] == "error" and "speed_mode" in last["message"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/audio/speech", {"speed_mode": "fast"}, "speed_mode"),
        ("/v1/tts", {"speed_mode": "fast"}, "speed_mode"),
        ("/v1/tts", {"speed": 5.0}, "speed"),
        ("/v1/audio/speech", {"speed": 1.5, "speed_mode": "stretch", "stream_format": "sse", "timestamps": True}, None),
        ("/v1/tts/captioned", {"speed": 1.5, "speed_mode": "stretch"}, None),
    ],
)
def test_bad_speed_requests(http, path, body, param):
    """A mode that is not one, a speed out of bounds, and timings asked of stretched audio (they would be
    estimates): 400 naming what is wrong."""
    if path == "/v1/audio/speech":
        body = {"model": "tts-1", "voice": "alloy", "input": TEXT, "response_format": "pcm", **body}
    else:
        body = tts_body(TOKENS, **body)
    err = check_openai_error(http.post(path, json=body), 400)
    if param is not None:
        assert param in err.get("param", "") + err.get("message", "")
    else:
        assert "speed_mode" in err["message"]
