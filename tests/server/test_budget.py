"""server/budget.py: one request, one audio budget. ``max_audio_seconds`` holds for the audio the client gets:
stretched audio at its stretched length, a dialogue's turns and an SSML document's ``<voice>`` runs together,
the pauses between them included; what cannot fit is a 400 up front. A non-streamed answer is spooled, not
held in memory (``AudioResponse.spooled``). Against a live in-process server with a 10 s budget."""

from __future__ import annotations

import base64
import json
import struct
import tempfile

import httpx
import pytest

from chattts_serve.models.chattts.config import TOKENS_PER_SECOND
from chattts_serve.server import audio_response

from .conftest import HTTP_TIMEOUT, SR, check_openai_error, decode_audio, running_server, ws_url

LIMIT_S = 10.0
SAY = "今天天气真不错。"
PLAIN = {"seed": 3, "refine_text": False}


@pytest.fixture(scope="module")
def http(tiny_ckpt, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("budget")
    flags = ("--max-audio-seconds", str(LIMIT_S), "--max-num-seqs", "8", "--no-warmup")
    with (
        running_server(tiny_ckpt, tmp, *flags, in_process=True) as base,
        httpx.Client(base_url=base, timeout=HTTP_TIMEOUT) as c,
    ):
        yield c


def _seconds(r: httpx.Response, fmt: str = "pcm") -> float:
    assert r.status_code == 200, r.text
    audio, rate = decode_audio(r.content, fmt)
    return len(audio) / rate


def _tokens(lo: int, hi: int) -> dict:
    return {"min_new_tokens": lo, "max_new_tokens": hi}


# ------------------------------------------------------------------------------ item 1: time stretch


@pytest.mark.parametrize("stream", [True, False])
def test_stretched_audio_counts_at_its_stretched_length(http, stream):
    """speed 0.25 makes 4x the audio: the model gets a quarter of the budget, the client at most the budget."""
    body = {"text": SAY, "format": "pcm", "speed": 0.25, "speed_mode": "stretch", "stream": stream, **PLAIN}
    r = http.post("/v1/tts", json={**body, **_tokens(60, 400)})
    seconds = _seconds(r)
    assert 4 * 60 / TOKENS_PER_SECOND - 0.1 < seconds <= LIMIT_S  # (400 tokens x 4 would be 34 s)


def test_openai_speech_stretch_is_in_the_budget(http):
    body = {"model": "tts-1", "input": SAY, "voice": "alloy", "response_format": "pcm", **PLAIN}
    r = http.post("/v1/audio/speech", json={**body, "speed": 0.25, "speed_mode": "both", **_tokens(110, 400)})
    assert _seconds(r) <= LIMIT_S


def test_a_websocket_part_counts_its_stretch(http):
    """Each WebSocket part is one request to the budget: its stretched audio at most ``max_audio_seconds``."""
    from websockets.sync.client import connect

    start = {"text": SAY, "format": "pcm", "speed": 0.25, "speed_mode": "stretch", **PLAIN, **_tokens(60, 400)}
    pcm = b""
    with connect(ws_url(str(http.base_url).rstrip("/")), open_timeout=10, close_timeout=5) as ws:
        ws.send(json.dumps({"type": "start", **start}))
        ws.send(json.dumps({"type": "end"}))
        for _ in range(10_000):  # bounded: the session ends with "end" (or "error")
            event = json.loads(ws.recv(timeout=HTTP_TIMEOUT))
            if event["type"] == "chunk" and event["bytes"]:
                pcm += ws.recv(timeout=HTTP_TIMEOUT)
            elif event["type"] in ("end", "error"):
                break
    assert event["type"] == "end", event
    assert 4 * 60 / TOKENS_PER_SECOND < len(pcm) / 2 / SR <= LIMIT_S


def test_a_stretched_minimum_over_the_budget_is_refused_up_front(http):
    body = {"text": SAY, "format": "pcm", "speed": 0.25, "speed_mode": "stretch", **PLAIN, **_tokens(200, 200)}
    err = check_openai_error(http.post("/v1/tts", json=body), 400)  # 4.3 s of speech, 17 s once stretched
    assert "speed 0.25" in err["message"] and "10 s" in err["message"], err
    assert _seconds(http.post("/v1/tts", json={**body, "speed_mode": "prompt"})) > 4  # unstretched it fits


def test_a_non_streamed_answer_is_spooled_not_held(http, monkeypatch):
    """Past ``SPOOL_BYTES`` the answer waits on disk; it is the streamed answer, with exact wav sizes."""
    monkeypatch.setattr(audio_response, "SPOOL_BYTES", 64 << 10)
    rolled = []
    real = tempfile.SpooledTemporaryFile

    class Spy(real):
        def rollover(self):
            rolled.append(self.tell())
            super().rollover()

    monkeypatch.setattr(tempfile, "SpooledTemporaryFile", Spy)
    body = {"text": SAY, "format": "wav", "sample_rate": 48000, "speed": 0.5, "speed_mode": "stretch", **PLAIN}
    body |= _tokens(100, 100)
    whole = http.post("/v1/tts", json={**body, "stream": False})
    assert whole.status_code == 200, whole.text
    assert len(rolled) == 1  # the body went to disk once past the spool's size
    assert int(whole.headers["content-length"]) == len(whole.content) > 64 << 10
    riff, data = struct.unpack_from("<I", whole.content, 4)[0], struct.unpack_from("<I", whole.content, 40)[0]
    assert (riff, data) == (len(whole.content) - 8, len(whole.content) - 44)
    streamed = http.post("/v1/tts", json={**body, "stream": True})
    assert whole.content[44:] == streamed.content[44:]
    assert _seconds(whole, "wav") == pytest.approx(2 * (512 * 100 - 256) / SR, abs=0.01)
    # /v1/tts/captioned: the JSON is written around the spooled audio, never the whole audio in memory
    rolled.clear()
    body = {k: v for k, v in body.items() if not k.startswith("speed")}
    doc = http.post("/v1/tts/captioned", json=body)
    assert doc.status_code == 200 and len(rolled) == 1, doc.text[:300]
    captioned = doc.json()
    audio = base64.b64decode(captioned["audio"])
    assert audio[44:] == http.post("/v1/tts", json={**body, "stream": False}).content[44:]
    assert captioned["duration_s"] == pytest.approx((512 * 100 - 256) / SR)
    assert captioned["segments"][0]["end_s"] == pytest.approx(captioned["duration_s"], abs=0.05)


# ------------------------------------------------------------------------------ item 3: turns share it


def _dialogue(turns: int, tokens: dict, pause_ms: int = 0, **extra) -> dict:
    return {
        "turns": [{"text": SAY, "voice": "alloy", **PLAIN, **tokens} for _ in range(turns)],
        "format": "pcm",
        "pause_ms": pause_ms,
        **extra,
    }


@pytest.mark.parametrize("stream", [True, False])
def test_dialogue_turns_share_one_budget(http, stream):
    r = http.post("/v1/dialogue", json=_dialogue(8, _tokens(20, 400), stream=stream))
    seconds = _seconds(r)  # (8 turns x 400 tokens would be 68 s)
    assert 8 * 20 / TOKENS_PER_SECOND < seconds <= LIMIT_S


def test_dialogue_turns_whose_minimum_passes_the_budget_are_refused(http):
    err = check_openai_error(http.post("/v1/dialogue", json=_dialogue(8, _tokens(100, 100))), 400)  # 8 x 2.1 s
    assert "8 turn(s)" in err["message"] and "max_audio_seconds" in err["message"], err
    assert _seconds(http.post("/v1/dialogue", json=_dialogue(4, _tokens(100, 100)))) > 8  # 4 x 2.1 s fits


def _ssml(runs: int) -> str:
    voices = ("nova", "alloy")
    return "<speak>" + "".join(f'<voice name="{voices[i % 2]}">{SAY}</voice>' for i in range(runs)) + "</speak>"


@pytest.mark.parametrize("stretch", [1.0, 0.25])
def test_ssml_voice_runs_share_one_budget(http, stretch):
    body = {"text": _ssml(8), "format": "pcm", "speed": stretch, "speed_mode": "stretch", **PLAIN}
    assert _seconds(http.post("/v1/tts", json={**body, **_tokens(2, 400)})) <= LIMIT_S
    err = check_openai_error(http.post("/v1/tts", json={**body, **_tokens(100, 100)}), 400)
    assert err["param"] == "text", err


# ------------------------------------------------------------------------------ item 5: pauses


def test_pauses_count_in_the_budget(http):
    r = http.post("/v1/dialogue", json=_dialogue(4, _tokens(2, 400), pause_ms=3000))  # 9 s of pauses
    assert 9 < _seconds(r) <= LIMIT_S
    err = check_openai_error(http.post("/v1/dialogue", json=_dialogue(5, _tokens(1, 1), pause_ms=3000)), 400)
    assert err["param"] == "pause_ms" and "12 s of pauses" in err["message"], err


def test_silence_is_not_free(http):
    """32 one-step turns with 5 s pauses: 155 s of silence from a 3 KB request, refused up front."""
    body = _dialogue(32, {"max_new_tokens": 1}, pause_ms=5000)
    body["turns"] = [{"text": "啊", "max_new_tokens": 1} for _ in range(32)]
    err = check_openai_error(http.post("/v1/dialogue", json=body), 400)
    assert "155 s" in err["message"] and "60 s" in err["message"], err
