"""Saved voices: CRUD over HTTP, use in synthesis, multipart sample upload, persistence across restarts;
then the limits (upload length and formats, names, count, transcript, pages), storage errors and crash
consistency."""

from __future__ import annotations

import asyncio
import io
import itertools
import json
import signal
import sqlite3
import threading
import time
import tracemalloc
import wave
from contextlib import closing, redirect_stdout

import httpx
import numpy as np
import pytest

from chattts_serve.models.chattts.speaker import decode_prompt_codes
from chattts_serve.server.voices import BUILTIN_VOICES, VoiceStore
from chattts_serve.server.voices_routes import decode_upload

from .conftest import (
    HTTP_TIMEOUT,
    SR,
    check_openai_error,
    expected_samples,
    running_server,
    start_server,
    wait_until,
    ws_url,
)

TEXT = "今天天气真不错。"
TOKENS = 40
FIXED = {"seed": 1, "refine_text": False, "min_new_tokens": TOKENS, "max_new_tokens": TOKENS}
PCM_BYTES = 2 * expected_samples(TOKENS)
OPENAI_VOICES = (
    "alloy", "ash", "ballad", "cedar", "coral", "echo", "fable", "marin", "nova", "onyx", "sage", "shimmer", "verse"
)  # fmt: skip


@pytest.fixture(scope="module")
def voices_tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("voices")


@pytest.fixture(scope="module")
def vserver(tiny_ckpt, voices_tmp):
    with start_server(tiny_ckpt, voices_tmp, "--no-warmup", in_process=True) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(vserver):
    with httpx.Client(base_url=vserver.base, timeout=HTTP_TIMEOUT) as c:
        yield c


@pytest.fixture(scope="module")
def cli_speaker(tiny_ckpt) -> str:
    """``chattts-serve speaker new``'s output, run in this process (tests/test_cli.py runs the command itself:
    a fresh interpreter here would cost seconds of torch import for the same string)."""
    from chattts_serve.cli import main

    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["speaker", "new", "--model", str(tiny_ckpt), "--seed", "3"]) == 0
    speaker = out.getvalue().strip()
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
    assert r.json() == {"object": "list", "data": [], "first_id": None, "last_id": None, "has_more": False}


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


# ------------------------------------------------------------------------------------------- blends


@pytest.fixture(scope="module")
def blend_parts(http) -> tuple[str, str]:
    for name, seed in (("mix-a", 31), ("mix-b", 32)):
        assert http.post("/v1/voices", json={"name": name, "seed": seed}).status_code == 201
    return "mix-a", "mix-b"


def test_a_blend_speaks_in_every_voice_field(http, blend_parts):
    a, b = blend_parts
    blend = f"{a}(2)+{b}(1)"
    mixed = speech_pcm(http, blend)
    assert speech_pcm(http, blend) == mixed  # same seed, same blend: same audio
    assert tts_pcm(http, voice=blend) == tts_pcm(http, speaker=blend) == mixed  # the native fields
    assert speech_pcm(http, f" {a}(4) + {b}(2) ") == mixed  # the weights are normalised
    assert mixed not in (speech_pcm(http, a), speech_pcm(http, b), speech_pcm(http, f"{a}+{b}"))
    assert speech_pcm(http, f"{a}+{a}") == speech_pcm(http, a)  # a voice blended with itself is that voice
    # built-in names and speaker strings mix too, and a speaker string stands for its saved voice
    assert speech_pcm(http, "alloy(2)+nova(1)") != speech_pcm(http, "alloy")
    speaker_b = http.get(f"/v1/voices/{b}").json()["speaker"]
    assert speech_pcm(http, f"{a}(2)+{speaker_b}(1)") == mixed


_blend_numbers = itertools.count()


def _unique_blends(a: str, b: str, n: int) -> list[str]:
    """``n`` blends no earlier request of this process mixed: weights 0.01 apart, each its own mix (blends
    that differ by less than 1/10,000 of their weights are one: params.canonical_blend)."""
    return [f"{a}({1 + next(_blend_numbers) / 100:.2f})+{b}(1)+alloy(2)+nova(3)" for _ in range(n)]


@pytest.mark.parametrize("route", ["tts", "speech", "dialogue", "ssml"])
def test_blends_are_mixed_off_the_event_loop(http, blend_parts, monkeypatch, route):
    """Mixing a blend (decoding its parts, mixing, encoding a speaker string) is a worker thread's work: while
    a request's blends are being mixed, the server answers /health (issue 29, item 4: 32 unique blends once
    froze every client for 1.5 s). The first mix is held until /health has answered: on the event loop it would
    hold the loop, and /health would wait for it."""
    from chattts_serve.models.chattts import voices as chattts_voices  # where ChatTTS mixes blends

    started, release, on_loop = threading.Event(), threading.Event(), []
    real = chattts_voices.blend_speakers

    def held_mix(*args):
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:  # no loop running in this thread: a worker's
            pass
        started.set()
        release.wait(10)
        return real(*args)

    monkeypatch.setattr(chattts_voices, "blend_speakers", held_mix)
    blends = _unique_blends(*blend_parts, 4)
    voices = "".join(f'<voice name="{b}">第{i}句。</voice>' for i, b in enumerate(blends))
    request = {
        "tts": ("/v1/tts", {"text": TEXT, "format": "pcm", "voice": blends[0], **FIXED}),
        "speech": (
            "/v1/audio/speech",
            {"model": "tts-1", "input": TEXT, "voice": blends[0], "response_format": "pcm", **FIXED},
        ),
        "dialogue": ("/v1/dialogue", {"turns": [{"text": TEXT, "voice": b, **FIXED} for b in blends], "format": "pcm"}),
        "ssml": ("/v1/tts", {"text": f"<speak>{voices}</speak>", "format": "pcm", **FIXED}),
    }[route]
    answer: list[httpx.Response] = []
    worker = threading.Thread(target=lambda: answer.append(http.post(request[0], json=request[1])), daemon=True)
    worker.start()
    try:
        assert started.wait(30), "the blend was never mixed"
        health = httpx.get(http.base_url.join("/health"), timeout=5)  # the loop is free while the mix runs
        assert health.status_code == 200
    finally:
        release.set()
        worker.join(60)
    assert answer and answer[0].status_code == 200, answer[0].text if answer else "no answer"
    assert not on_loop


def test_a_blend_can_be_saved(http, blend_parts):
    a, b = blend_parts
    r = http.post("/v1/voices", json={"name": "mix-21", "speaker": f"{a}(2)+{b}(1)", "description": "2:1"})
    assert r.status_code == 201, r.text
    saved = r.json()
    assert saved["kind"] == "speaker" and len(saved["speaker"]) >= 16 and saved["description"] == "2:1"
    assert speech_pcm(http, "mix-21") == speech_pcm(http, f"{a}(2)+{b}(1)")
    assert tts_pcm(http, speaker=saved["speaker"]) == speech_pcm(http, "mix-21")
    # a saved blend is a voice like any other: it can be blended again
    assert speech_pcm(http, f"mix-21+{a}") not in (speech_pcm(http, "mix-21"), speech_pcm(http, a))
    err = check_openai_error(http.post("/v1/voices", json={"name": "mix-bad", "speaker": f"{a}(0)+{b}"}), 400)
    assert err["param"] == "speaker" and err["code"] == "invalid_blend" and f"'{a}(0)'" in err["message"]
    assert http.get("/v1/voices/mix-bad").status_code == 404


def test_bad_blends_are_400s_naming_the_term(http, blend_parts):
    a, b = blend_parts
    files = {"file": ("sine.wav", sine_wav(1.0), "audio/wav")}
    assert http.post("/v1/voices", data={"name": "mix-rec", "text": "你好。"}, files=files).status_code == 201
    cases = {
        f"{a}+nobody": ("unknown_voice", "'nobody'"),
        f"{a}(0)+{b}": ("invalid_blend", f"'{a}(0)'"),
        f"{a}+{b}(-2)": ("invalid_blend", f"'{b}(-2)'"),
        f"{a}(nan)+{b}": ("invalid_blend", f"'{a}(nan)'"),
        f"{a}++{b}": ("invalid_blend", "term 2 is empty"),
        "+".join([a] * 9): ("invalid_blend", "at most 8"),
        f"{a}+mix-rec": ("invalid_blend", "'mix-rec' is a voice sample"),
    }
    for voice, (code, says) in cases.items():
        body = {"model": "tts-1", "input": TEXT, "voice": voice, **FIXED}
        err = check_openai_error(http.post("/v1/audio/speech", json=body), 400)
        assert err["code"] == code and says in err["message"] and err["param"] == "voice", (voice, err)
        err = check_openai_error(http.post("/v1/tts", json={"text": TEXT, "speaker": voice, **FIXED}), 400)
        assert err["code"] == code and says in err["message"], (voice, err)
    assert speech_pcm(http, "mix-rec(3)")  # alone, a voice sample is no blend: it speaks


def test_a_blend_starts_a_websocket_stream(vserver, http, blend_parts):
    from websockets.sync.client import connect

    blend = "{}(2)+{}(1)".format(*blend_parts)
    with connect(ws_url(vserver.base), open_timeout=10, close_timeout=5) as ws:
        ws.send(json.dumps({"type": "start", "format": "pcm", "voice": blend, "text": TEXT, **FIXED}))
        ws.send(json.dumps({"type": "end"}))
        pcm, event = b"", {}
        while event.get("type") != "end":
            msg = ws.recv(timeout=HTTP_TIMEOUT)
            if isinstance(msg, bytes):
                pcm += msg
            else:
                event = json.loads(msg)
                assert event["type"] in ("start", "chunk", "end"), event
    assert pcm == tts_pcm(http, voice=blend)


def test_every_openai_voice_name_is_a_speaker():
    assert set(OPENAI_VOICES) == set(BUILTIN_VOICES)
    assert len(set(BUILTIN_VOICES.values())) == len(BUILTIN_VOICES)  # each its own speaker
    # a name's seed is its place: the eleven older names keep the voices they had
    assert BUILTIN_VOICES["alloy"] == 1000 and BUILTIN_VOICES["verse"] == 1010


def test_list_pages(http):
    """GET /v1/voices pages with ?limit= and ?after=<name>, in OpenAI's list shape."""
    for i in range(5):
        assert http.post("/v1/voices", json={"name": f"pg-{i}", "seed": 20 + i}).status_code == 201
    everything = http.get("/v1/voices", params={"limit": 1000}).json()
    assert everything["has_more"] is False
    names = [v["name"] for v in everything["data"]]
    assert everything["first_id"] == names[0] and everything["last_id"] == names[-1]
    walked, after = [], None
    for _ in range(len(names)):  # bounded: each page holds at least one voice
        body = http.get("/v1/voices", params={"limit": 2, **({"after": after} if after else {})}).json()
        page = [v["name"] for v in body["data"]]
        assert body["object"] == "list" and 1 <= len(page) <= 2
        assert body["last_id"] == page[-1]
        walked += page
        if not body["has_more"]:
            break
        after = body["last_id"]
    assert walked == names
    assert http.get("/v1/voices", params={"after": names[-1]}).json()["data"] == []
    for bad in ("0", "1001", "-1", "ten"):
        check_openai_error(http.get("/v1/voices", params={"limit": bad}), 400)


BAD_NAMES = [".", "..", ".hidden", "a/b", "a b", "a\n", "\uff41lice", "\u0410lice", "na\u00efve", "名字", "x" * 65, ""]


@pytest.mark.parametrize("name", BAD_NAMES, ids=[repr(n) for n in BAD_NAMES])
def test_voice_name_rules(http, name):
    """Names are plain ASCII: no Unicode look-alikes (fullwidth a, Cyrillic A), no ".", "..", no hidden name."""
    err = check_openai_error(http.post("/v1/voices", json={"name": name, "seed": 1}), 400)
    assert err["param"] == "name"
    files = {"file": ("s.wav", sine_wav(0.5), "audio/wav")}
    err = check_openai_error(http.post("/v1/voices", data={"name": name, "text": "x"}, files=files), 400)
    assert err["param"] == "name"
    assert name not in [v["name"] for v in http.get("/v1/voices", params={"limit": 1000}).json()["data"]]


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", None])
def test_json_voice_needs_json_content_type(http, ctype):
    """A JSON body without Content-Type: application/json (a cross-site text/plain POST) creates nothing."""
    headers = {"content-type": ctype} if ctype else {}
    r = http.post("/v1/voices", content=json.dumps({"name": "csrf", "seed": 1}), headers=headers)
    assert check_openai_error(r, 415)["code"] == "unsupported_media_type"
    assert http.get("/v1/voices/csrf").status_code == 404


def test_json_content_type_with_charset(http):
    headers = {"content-type": "application/json; charset=utf-8"}
    r = http.post("/v1/voices", content=json.dumps({"name": "charset", "seed": 1}), headers=headers)
    assert r.status_code == 201, r.text
    assert http.delete("/v1/voices/charset").status_code == 200


def test_upload_parts_must_be_of_the_right_kind(http):
    """'file' must be a file part (not a text field); 'name' and 'text' must be text fields (not files)."""
    other = {"other": ("o.bin", b"x", "application/octet-stream")}  # keeps the body multipart
    r = http.post("/v1/voices", data={"name": "kind1", "text": "x", "file": "RIFF" + "x" * 100}, files=other)
    assert check_openai_error(r, 400)["param"] == "file"
    files = {"file": ("s.wav", sine_wav(), "audio/wav"), "text": ("t.txt", b"transcript", "text/plain")}
    r = http.post("/v1/voices", data={"name": "kind2"}, files=files)
    assert check_openai_error(r, 400)["param"] == "text"
    files = {"file": ("s.wav", sine_wav(), "audio/wav"), "name": ("n.txt", b"kind3", "text/plain")}
    r = http.post("/v1/voices", data={"text": "x"}, files=files)
    assert check_openai_error(r, 400)["param"] == "name"
    for name in ("kind1", "kind2", "kind3"):
        assert http.get(f"/v1/voices/{name}").status_code == 404


NOT_AUDIO = {
    "ffconcat-existing-path": b"ffconcat version 1.0\nfile '/etc/passwd'\n",
    "ffconcat-missing-path": b"ffconcat version 1.0\nfile '/no/such/dir/secret.wav'\n",
    "ffconcat-relative": b"ffconcat version 1.0\nfile 'voices.sqlite3'\n",
    "hls": b"#EXTM3U\n#EXT-X-TARGETDURATION:10\n#EXTINF:10,\nfile:///etc/passwd\n#EXT-X-ENDLIST\n",
    "text": b"hello, this is not audio at all\n" * 40,
    "png": b"\x89PNG\r\n\x1a\n" + b"\x00" * 400,
}


def test_upload_refuses_non_audio_formats(http):
    """Only audio demuxers may open an upload: text formats that reference server files (ffconcat, hls)
    and other files are refused with one generic message (it does not tell whether a path exists, and
    carries no ffmpeg error text)."""
    messages = set()
    for label, data in NOT_AUDIO.items():
        files = {"file": ("a.wav", data, "audio/wav")}
        r = http.post("/v1/voices", data={"name": f"bad-{label}", "text": "x"}, files=files)
        err = check_openai_error(r, 400)
        assert err["param"] == "file", label
        assert "passwd" not in r.text and "secret" not in r.text and "sqlite" not in r.text
        messages.add(err["message"])
        assert http.get(f"/v1/voices/bad-{label}").status_code == 404
    assert len(messages) == 1, messages


def test_voices_survive_restart(tiny_ckpt, voices_tmp, vserver, http):
    """Runs last of the tests on the module's server: it stops it and starts a new one on the same file."""
    before = {v["name"]: v for v in http.get("/v1/voices").json()["data"]}
    assert {"spk3", "seed7", "sample1"} <= set(before)
    spk3_audio = speech_pcm(http, "spk3")
    sample_audio = speech_pcm(http, "sample1")
    vserver.stop()
    db = str(voices_tmp / "voices.sqlite3")
    with running_server(tiny_ckpt, voices_tmp, "--no-warmup", "--voices-db", db, in_process=True) as base2:
        with httpx.Client(base_url=base2, timeout=HTTP_TIMEOUT) as h2:
            after = {v["name"]: v for v in h2.get("/v1/voices").json()["data"]}
            assert after == before
            assert speech_pcm(h2, "spk3") == spk3_audio
            assert speech_pcm(h2, "sample1") == sample_audio


# ------------------------------------------------------------------------------------ upload length

LIMIT_S = 2.0
CODES_PER_S = SR / 512  # the DVAE gives one code frame per 512 samples: 46.875 per second


def silent_flac(seconds: float, rate: int = 8000) -> bytes:
    """FLAC of digital silence: each block is stored as one constant, so an hour is ~0.65 MB."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="flac") as out:
        stream = out.add_stream("flac", rate=rate, layout="mono")
        block = np.zeros((1, 16384), np.int16)
        for start in range(0, int(seconds * rate), block.shape[1]):
            frame = av.AudioFrame.from_ndarray(block, format="s16", layout="mono")
            frame.sample_rate, frame.pts = rate, start
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()


def test_decode_stops_at_the_limit():
    """Decoding stops once max_seconds are there: ten minutes of FLAC silence never expand into memory
    (tracemalloc sees numpy's buffers; ten minutes at 24 kHz would be 57 MB of float32)."""
    data = silent_flac(600)
    tracemalloc.start()
    try:
        wav = decode_upload(data, LIMIT_S, SR)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert wav.dtype == np.float32 and len(wav) == int(LIMIT_S * SR)
    assert peak < 8 << 20, f"decoding kept {peak / 1e6:.0f} MB"
    assert len(decode_upload(sine_wav(1.0), LIMIT_S, SR)) == SR  # a shorter file is kept whole


@pytest.fixture(scope="module")
def lserver(tiny_ckpt, tmp_path_factory):
    """A server with small voice limits: 2 s uploads, 3 voices, 20-character transcripts."""
    tmp = tmp_path_factory.mktemp("voice-limits")
    limits = ("--max-upload-seconds", str(LIMIT_S), "--max-voices", "3", "--max-voice-text-chars", "20")
    with start_server(tiny_ckpt, tmp, "--no-warmup", *limits, in_process=True) as srv:
        yield srv, tmp / "voices.sqlite3"


def stored_code_frames(db, name: str) -> int:
    with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)) as conn:
        (codes,) = conn.execute("SELECT sample_codes FROM voices WHERE name = ?", (name,)).fetchone()
    return decode_prompt_codes(codes).shape[1]


class HealthPoller(threading.Thread):
    """Polls /health; counts the 200s to requests sent and answered while ``window`` is set."""

    def __init__(self, base: str) -> None:
        super().__init__(daemon=True)
        self.base = base
        self.window, self.stop = threading.Event(), threading.Event()
        self.answered = self.answered_in_window = 0
        self.errors: list[str] = []

    def run(self) -> None:
        with httpx.Client(base_url=self.base, timeout=HTTP_TIMEOUT) as c:
            while not self.stop.is_set():
                opened = self.window.is_set()
                try:
                    status = c.get("/health").status_code
                except httpx.HTTPError as exc:
                    self.errors.append(repr(exc))
                    continue
                self.answered += status == 200
                self.answered_in_window += status == 200 and opened and self.window.is_set()


def test_long_upload_is_cut_to_the_limit_and_server_stays_live(lserver):
    """An hour of FLAC silence (under max_body_bytes) is accepted, only its first max_upload_seconds are
    kept, and /health answers while the upload is processed."""
    srv, db = lserver
    data = silent_flac(3600)
    assert len(data) < 1 << 20
    poller = HealthPoller(srv.base)
    poller.start()
    try:
        assert wait_until(lambda: poller.answered > 0, timeout=30)
        with httpx.Client(base_url=srv.base, timeout=HTTP_TIMEOUT) as http:
            for _ in range(5):  # bounded: an upload faster than one /health round trip is tried again
                poller.window.set()
                r = http.post("/v1/voices", data={"name": "hour", "text": "x"}, files={"file": ("h.flac", data)})
                poller.window.clear()
                assert r.status_code == 201, r.text
                assert abs(stored_code_frames(db, "hour") - LIMIT_S * CODES_PER_S) <= 1
                assert http.delete("/v1/voices/hour").status_code == 200
                if poller.answered_in_window:
                    break
    finally:
        poller.stop.set()
        poller.join(timeout=HTTP_TIMEOUT)
    assert poller.answered_in_window > 0 and not poller.errors, poller.errors


def test_transcript_length_cap(lserver):
    srv, _ = lserver
    with httpx.Client(base_url=srv.base, timeout=HTTP_TIMEOUT) as http:
        files = {"file": ("s.wav", sine_wav(0.5), "audio/wav")}
        r = http.post("/v1/voices", data={"name": "long-text", "text": "好" * 21}, files=files)
        err = check_openai_error(r, 400)
        assert err["param"] == "text" and err["code"] == "input_too_long"
        assert http.get("/v1/voices/long-text").status_code == 404
        r = http.post("/v1/voices", data={"name": "ok-text", "text": "好" * 20}, files=files)
        assert r.status_code == 201, r.text
        assert http.delete("/v1/voices/ok-text").status_code == 200


def test_voice_count_cap(lserver):
    """max_voices: beyond it 409 voice_limit_reached (JSON and uploads); deleting one makes room."""
    srv, _ = lserver
    with httpx.Client(base_url=srv.base, timeout=HTTP_TIMEOUT) as http:
        held = len(http.get("/v1/voices").json()["data"])
        for i in range(3 - held):
            assert http.post("/v1/voices", json={"name": f"cap-{i}", "seed": i}).status_code == 201
        err = check_openai_error(http.post("/v1/voices", json={"name": "one-too-many", "seed": 9}), 409)
        assert err["code"] == "voice_limit_reached" and "3" in err["message"]
        files = {"file": ("s.wav", sine_wav(0.5), "audio/wav")}
        r = http.post("/v1/voices", data={"name": "one-too-many", "text": "x"}, files=files)
        assert check_openai_error(r, 409)["code"] == "voice_limit_reached"
        assert len(http.get("/v1/voices").json()["data"]) == 3
        assert http.delete("/v1/voices/cap-0").status_code == 200
        assert http.post("/v1/voices", json={"name": "one-more", "seed": 9}).status_code == 201


# ------------------------------------------------------------------------------------ storage errors


@pytest.fixture(scope="module")
def inproc(tiny_ckpt, tmp_path_factory):
    """The app in this process (fastapi TestClient), so a test can reach into its voice store."""
    from fastapi.testclient import TestClient

    from chattts_serve.server.app import create_app
    from chattts_serve.server.config import ServerConfig

    db = tmp_path_factory.mktemp("voices-inproc") / "voices.sqlite3"
    app = create_app(ServerConfig.from_flat(model=str(tiny_ckpt), device="cpu", voices_db=str(db), warmup=False))
    with TestClient(app) as client:
        yield app, client, db


def test_locked_database_is_503_with_retry_after(inproc):
    app, client, db = inproc
    app.state.voices.close()
    app.state.voices = VoiceStore(db, busy_timeout_s=0.2)  # the test need not sit out the default wait
    with closing(sqlite3.connect(db, timeout=10, isolation_level=None)) as other:
        other.execute("BEGIN EXCLUSIVE")  # another process holds the write lock
        try:
            r = client.post("/v1/voices", json={"name": "locked", "seed": 1})
            assert check_openai_error(r, 503)["code"] == "storage_busy"
            assert r.headers["retry-after"] == "1"
            assert client.get("/v1/voices").status_code == 200  # readers do not wait for a writer (WAL)
        finally:
            other.execute("ROLLBACK")
    assert client.post("/v1/voices", json={"name": "locked", "seed": 1}).status_code == 201


def test_full_disk_is_507(inproc):
    app, client, _ = inproc
    # SQLite's own size cap on the store's write connection makes the database genuinely full
    # (SQLITE_FULL, "database or disk is full"), as a full disk would.
    writer = app.state.voices._writer
    (pages,) = writer.execute("PRAGMA page_count").fetchone()
    writer.execute(f"PRAGMA max_page_count = {pages}")
    try:
        for i in range(500):  # bounded: a page holds a few dozen voices
            r = client.post("/v1/voices", json={"name": f"full-{i}", "seed": i})
            if r.status_code != 201:
                break
        assert check_openai_error(r, 507)["code"] == "storage_full"
        assert client.get("/v1/voices").status_code == 200
    finally:
        writer.execute("PRAGMA max_page_count = 1073741823")
    assert client.post("/v1/voices", json={"name": "after-full", "seed": 1}).status_code == 201


def test_other_storage_errors_are_json_500(inproc):
    app, client, db = inproc
    app.state.voices.close()  # every call now fails inside sqlite3
    try:
        for r in (
            client.post("/v1/voices", json={"name": "closed", "seed": 1}),
            client.get("/v1/voices"),
            client.get("/v1/voices/locked"),
            client.delete("/v1/voices/locked"),
        ):
            assert check_openai_error(r, 500)["code"] == "storage_error"
    finally:
        app.state.voices = VoiceStore(db)
    assert client.get("/v1/voices/locked").status_code == 200


def test_uploads_hold_the_servers_requests_in_flight(inproc, monkeypatch):
    """An upload's decode and encode is one of the server's requests in flight: past the limit, an upload (and
    a synthesis request) gets 429 as synthesis does, and the slot is free again once the upload is done."""
    from chattts_serve.server import voices_routes
    from chattts_serve.server.limits import Limits

    app, client, _ = inproc
    decoding, release = threading.Event(), threading.Event()

    def slow_decode(data: bytes, max_seconds: float, rate: int) -> np.ndarray:
        decoding.set()
        assert release.wait(30)
        return decode_upload(data, max_seconds, rate)

    def upload(name: str):
        files = {"file": ("s.wav", sine_wav(), "audio/wav")}
        return client.post("/v1/voices", data={"name": name, "text": "你好。"}, files=files)

    monkeypatch.setattr(voices_routes, "decode_upload", slow_decode)
    monkeypatch.setattr(app.state, "limits", Limits(1))
    results = {}
    first = threading.Thread(target=lambda: results.update(first=upload("flood-1")))
    first.start()
    try:
        assert decoding.wait(30)
        assert check_openai_error(upload("flood-2"), 429)["code"] == "capacity"
        tts = client.post("/v1/tts", json={"text": TEXT, "format": "pcm", **FIXED})
        assert check_openai_error(tts, 429)["code"] == "capacity"
    finally:
        release.set()
        first.join(60)
    assert results["first"].status_code == 201, results["first"].text
    assert app.state.limits.in_flight == 0
    assert upload("flood-2").status_code == 201


# ------------------------------------------------------------------------------------ crash consistency


@pytest.mark.integration
def test_kill_9_keeps_every_acknowledged_voice(tiny_ckpt, tmp_path_factory):
    """Voices are created in a loop while the server is SIGKILLed: afterwards the database passes its
    integrity check and holds every voice that was answered 201."""
    tmp = tmp_path_factory.mktemp("voices-crash")
    created: list[str] = []
    unexpected: list[str] = []

    def create_in_a_loop(base: str) -> None:
        deadline = time.monotonic() + 120  # a bound, not a check: the kill normally ends the loop
        with httpx.Client(base_url=base, timeout=10) as c:
            for i in range(100_000):
                if time.monotonic() > deadline:
                    return
                name = f"crash-{i}"
                try:
                    if i % 5 == 4:  # some voice samples among the speaker voices
                        files = {"file": ("s.wav", sine_wav(0.5), "audio/wav")}
                        r = c.post("/v1/voices", data={"name": name, "text": "x"}, files=files)
                    else:
                        r = c.post("/v1/voices", json={"name": name, "seed": i})
                except httpx.HTTPError:
                    return  # the server is gone
                if r.status_code == 201:
                    created.append(name)
                else:
                    unexpected.append(f"{r.status_code} {r.text}")

    with start_server(tiny_ckpt, tmp, "--no-warmup") as srv:
        loop = threading.Thread(target=create_in_a_loop, args=(srv.base,), daemon=True)
        loop.start()
        assert wait_until(lambda: len(created) >= 25, timeout=120), srv.log()
        srv.proc.send_signal(signal.SIGKILL)
        assert srv.proc.wait(timeout=30) == -signal.SIGKILL
        loop.join(timeout=60)
        assert not loop.is_alive()
    assert not unexpected, unexpected
    with closing(sqlite3.connect(tmp / "voices.sqlite3", timeout=10)) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        stored = {name for (name,) in conn.execute("SELECT name FROM voices")}
    assert set(created) <= stored
