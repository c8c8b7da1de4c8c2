"""Saved voices: CRUD over HTTP, use in synthesis, multipart sample upload, persistence across restarts."""

from __future__ import annotations

import io
import signal
import subprocess
import sys
import wave

import httpx
import numpy as np
import pytest

from .conftest import HTTP_TIMEOUT, SR, check_openai_error, expected_samples, running_server, start_server

TEXT = "今天天气真不错。"
TOKENS = 40
FIXED = {"seed": 1, "refine_text": False, "min_new_tokens": TOKENS, "max_new_tokens": TOKENS}
PCM_BYTES = 2 * expected_samples(TOKENS)


@pytest.fixture(scope="module")
def voices_tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("voices")


@pytest.fixture(scope="module")
def vserver(tiny_ckpt, voices_tmp):
    with start_server(tiny_ckpt, voices_tmp, "--no-warmup") as srv:
        yield srv


@pytest.fixture(scope="module")
def http(vserver):
    with httpx.Client(base_url=vserver.base, timeout=HTTP_TIMEOUT) as c:
        yield c


@pytest.fixture(scope="module")
def cli_speaker(tiny_ckpt) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "chattts_serve.cli", "speaker", "new", "--model", str(tiny_ckpt), "--seed", "3"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    speaker = out.stdout.strip()
    assert len(speaker) >= 16 and "\n" not in speaker
    return speaker


def sine_wav(seconds: float = 1.0, freq: float = 220.0) -> bytes:
    t = np.arange(int(SR * seconds)) / SR
    x = (0.3 * np.sin(2 * np.pi * freq * t) * 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(SR)
        w.writeframes(x.tobytes())
    return buf.getvalue()


def speech_pcm(http, voice: str) -> bytes:
    r = http.post(
        "/v1/audio/speech", json={"model": "tts-1", "input": TEXT, "voice": voice, "response_format": "pcm", **FIXED}
    )
    assert r.status_code == 200, r.text
    assert len(r.content) == PCM_BYTES
    return r.content


def tts_pcm(http, **voice) -> bytes:
    r = http.post("/v1/tts", json={"text": TEXT, "format": "pcm", **voice, **FIXED})
    assert r.status_code == 200, r.text
    assert len(r.content) == PCM_BYTES
    return r.content


def test_empty_list(http):
    r = http.get("/v1/voices")
    assert r.status_code == 200
    assert r.json() == {"object": "list", "data": []}


def test_create_from_speaker_and_seed(http, cli_speaker):
    r = http.post("/v1/voices", json={"name": "spk3", "speaker": cli_speaker, "description": "from the CLI"})
    assert r.status_code == 201, r.text
    v = r.json()
    assert v["name"] == "spk3" and v["kind"] == "speaker" and v["speaker"] == cli_speaker
    assert v["description"] == "from the CLI" and isinstance(v["created_at"], float)

    r = http.post("/v1/voices", json={"name": "seed7", "seed": 7})
    assert r.status_code == 201, r.text
    seeded = r.json()
    assert seeded["kind"] == "speaker" and len(seeded["speaker"]) >= 16
    # the same seed gives the same speaker
    r = http.post("/v1/voices", json={"name": "seed7.again", "seed": 7})
    assert r.status_code == 201 and r.json()["speaker"] == seeded["speaker"]
    # a voice made from another voice's speaker string (GET it first)
    speaker = http.get("/v1/voices/seed7").json()["speaker"]
    r = http.post("/v1/voices", json={"name": "copy-of-seed7", "speaker": speaker})
    assert r.status_code == 201 and r.json()["speaker"] == speaker


def test_duplicate_is_409(http):
    err = check_openai_error(http.post("/v1/voices", json={"name": "seed7", "seed": 8}), 409)
    assert err["code"] == "voice_exists"
    assert http.get("/v1/voices/seed7").json()["speaker"] == http.get("/v1/voices/seed7.again").json()["speaker"]


def test_list_and_get(http, cli_speaker):
    data = http.get("/v1/voices").json()["data"]
    names = [v["name"] for v in data]
    assert names == sorted(names)
    assert {"spk3", "seed7", "seed7.again", "copy-of-seed7"} <= set(names)
    r = http.get("/v1/voices/spk3")
    assert r.status_code == 200
    assert r.json()["speaker"] == cli_speaker and r.json()["kind"] == "speaker"


def test_use_voice_by_name(http, cli_speaker):
    no_voice = tts_pcm(http)
    by_name = speech_pcm(http, "spk3")
    assert by_name == tts_pcm(http, voice="spk3")
    assert by_name == tts_pcm(http, speaker=cli_speaker)  # the saved voice is that speaker string
    assert by_name == speech_pcm(http, cli_speaker)
    assert by_name != no_voice  # the speaker embedding changes the audio
    assert speech_pcm(http, "seed7") == speech_pcm(http, "copy-of-seed7")
    assert speech_pcm(http, "seed7") != by_name


def test_sample_upload(http):
    files = {"file": ("sine.wav", sine_wav(1.0), "audio/wav")}
    r = http.post("/v1/voices", data={"name": "sample1", "text": "你好，这是一段测试录音。"}, files=files)
    assert r.status_code == 201, r.text
    v = r.json()
    assert v["kind"] == "sample" and v["speaker"] is None and v["sample_text"] == "你好，这是一段测试录音。"
    assert http.get("/v1/voices/sample1").json()["kind"] == "sample"
    pcm = speech_pcm(http, "sample1")
    assert pcm == tts_pcm(http, voice="sample1")
    assert pcm != tts_pcm(http)
    # a duplicate upload is a 409 too
    files = {"file": ("s.wav", sine_wav(), "audio/wav")}
    r = http.post("/v1/voices", data={"name": "sample1", "text": "x"}, files=files)
    check_openai_error(r, 409)


def test_upload_too_short_or_not_audio(http):
    r = http.post(
        "/v1/voices", data={"name": "short", "text": "x"}, files={"file": ("s.wav", sine_wav(0.1), "audio/wav")}
    )
    assert check_openai_error(r, 400)["param"] == "file"
    r = http.post(
        "/v1/voices",
        data={"name": "junk", "text": "x"},
        files={"file": ("j.wav", b"this is not audio" * 100, "audio/wav")},
    )
    assert check_openai_error(r, 400)["param"] == "file"
    assert http.get("/v1/voices/short").status_code == 404
    assert http.get("/v1/voices/junk").status_code == 404


def test_delete(http):
    r = http.post("/v1/voices", json={"name": "temp", "seed": 11})
    assert r.status_code == 201
    r = http.delete("/v1/voices/temp")
    assert r.status_code == 200 and r.json() == {"deleted": "temp"}
    assert check_openai_error(http.get("/v1/voices/temp"), 404)["code"] == "voice_not_found"
    check_openai_error(http.delete("/v1/voices/temp"), 404)
    err = check_openai_error(
        http.post("/v1/audio/speech", json={"model": "tts-1", "input": TEXT, "voice": "temp", **FIXED}), 400
    )
    assert err["code"] == "unknown_voice"
    check_openai_error(http.post("/v1/tts", json={"text": TEXT, "voice": "temp", **FIXED}), 400)
    assert "temp" not in [v["name"] for v in http.get("/v1/voices").json()["data"]]
    # the name is free again
    assert http.post("/v1/voices", json={"name": "temp", "seed": 12}).status_code == 201
    assert http.delete("/v1/voices/temp").status_code == 200


def test_saved_voice_shadows_builtin_name(http):
    builtin = speech_pcm(http, "nova")
    assert http.post("/v1/voices", json={"name": "nova", "seed": 5}).status_code == 201
    try:
        assert speech_pcm(http, "nova") != builtin
        assert speech_pcm(http, "nova") == tts_pcm(http, speaker=http.get("/v1/voices/nova").json()["speaker"])
    finally:
        assert http.delete("/v1/voices/nova").status_code == 200
    assert speech_pcm(http, "nova") == builtin


def test_voices_survive_restart(tiny_ckpt, voices_tmp, vserver, http):
    """Runs last in this module: it stops the module's server and starts a new one on the same file."""
    before = {v["name"]: v for v in http.get("/v1/voices").json()["data"]}
    assert {"spk3", "seed7", "sample1"} <= set(before)
    spk3_audio = speech_pcm(http, "spk3")
    sample_audio = speech_pcm(http, "sample1")
    vserver.proc.terminate()
    assert vserver.proc.wait(timeout=30) in (0, -signal.SIGTERM)
    db = str(voices_tmp / "voices.sqlite3")
    with running_server(tiny_ckpt, voices_tmp, "--no-warmup", "--voices-db", db) as base2:
        with httpx.Client(base_url=base2, timeout=HTTP_TIMEOUT) as h2:
            after = {v["name"]: v for v in h2.get("/v1/voices").json()["data"]}
            assert after == before
            assert speech_pcm(h2, "spk3") == spk3_audio
            assert speech_pcm(h2, "sample1") == sample_audio
