"""A table of bad requests against the session server: each gets the right status and an OpenAI-shaped
JSON error, and the server stays healthy afterwards."""

from __future__ import annotations

import json

import httpx
import pytest

from .conftest import HTTP_TIMEOUT, check_openai_error, expected_samples

SPEECH = {
    "model": "tts-1",
    "voice": "alloy",
    "input": "你好。",
    "response_format": "pcm",
    "seed": 1,
    "refine_text": False,
    "max_new_tokens": 8,
    "min_new_tokens": 8,
}
TTS = {"text": "你好。", "format": "pcm", "seed": 1, "refine_text": False, "max_new_tokens": 8, "min_new_tokens": 8}
DUP = "dup-voice"
JSON = {"content-type": "application/json"}


def speech(**changes):
    """The good speech body with fields changed (``...`` removes one)."""
    body = {**SPEECH, **changes}
    return {"json": {k: v for k, v in body.items() if v is not ...}}


def tts(**changes):
    body = {**TTS, **changes}
    return {"json": {k: v for k, v in body.items() if v is not ...}}


def raw(text: str | bytes, headers=JSON):
    return {"content": text.encode() if isinstance(text, str) else text, "headers": headers}


def speech_raw(field_json: str):
    """The good speech body as JSON text with one more raw member (for NaN / Infinity)."""
    return raw(json.dumps(SPEECH)[:-1] + ", " + field_json + "}")


def junk_upload(name="up", data=b"RIFF\x00\x00\x00\x00WAVEjunk" + b"\x00" * 400):
    return {"data": {"name": name, "text": "你好"}, "files": {"file": ("a.wav", data, "audio/wav")}}


S, T, V = "/v1/audio/speech", "/v1/tts", "/v1/voices"
# (id, method, path, request kwargs, status, expected error param or code (None: not checked))
CASES = [
    ("empty-input", "POST", S, speech(input=""), 400, "input"),
    ("whitespace-input", "POST", S, speech(input="   \n\t "), 400, None),
    ("input-too-long", "POST", S, speech(input="好" * 4097), 400, "input_too_long"),
    ("text-too-long", "POST", T, tts(text="好" * 4097), 400, "input_too_long"),
    ("missing-input", "POST", S, speech(input=...), 400, "input"),
    ("missing-model", "POST", S, speech(model=...), 400, "model"),
    ("missing-voice", "POST", S, speech(voice=...), 400, "voice"),
    ("missing-text", "POST", T, tts(text=...), 400, "text"),
    ("input-number", "POST", S, speech(input=42), 400, "input"),
    ("input-list", "POST", S, speech(input=["你好"]), 400, "input"),
    ("text-null", "POST", T, tts(text=None), 400, "text"),
    ("speed-string", "POST", S, speech(speed="fast"), 400, "speed"),
    ("speed-too-high", "POST", S, speech(speed=10), 400, "speed"),
    ("speed-zero", "POST", S, speech(speed=0), 400, "speed"),
    ("seed-float", "POST", S, speech(seed=1.5), 400, "seed"),
    ("seed-negative", "POST", S, speech(seed=-1), 400, "seed"),
    ("seed-huge", "POST", S, speech(seed=2**64), 400, "seed"),
    ("seed-string", "POST", T, tts(seed="abc"), 400, "seed"),
    ("temperature-zero", "POST", S, speech(temperature=0), 400, "temperature"),
    ("temperature-negative", "POST", S, speech(temperature=-0.5), 400, "temperature"),
    ("temperature-nan", "POST", S, speech_raw('"temperature": NaN'), 400, "temperature"),
    ("temperature-inf", "POST", S, speech_raw('"temperature": Infinity'), 400, "temperature"),
    ("temperature-minus-inf", "POST", T, raw(json.dumps(TTS)[:-1] + ', "temperature": -Infinity}'), 400, "temperature"),
    ("top-p-zero", "POST", S, speech(top_p=0), 400, "top_p"),
    ("top-p-two", "POST", S, speech(top_p=2), 400, "top_p"),
    ("top-p-nan", "POST", T, raw(json.dumps(TTS)[:-1] + ', "top_p": NaN}'), 400, "top_p"),
    ("top-k-negative", "POST", S, speech(top_k=-1), 400, "top_k"),
    ("top-k-float", "POST", T, tts(top_k=2.5), 400, "top_k"),
    ("max-new-tokens-zero", "POST", S, speech(max_new_tokens=0, min_new_tokens=0), 400, "max_new_tokens"),
    ("min-over-max", "POST", S, speech(min_new_tokens=20, max_new_tokens=10), 400, None),
    ("min-over-max-tts", "POST", T, tts(min_new_tokens=20, max_new_tokens=10), 400, None),
    ("repetition-penalty-zero", "POST", T, tts(repetition_penalty=0), 400, "repetition_penalty"),
    ("refine-temperature-zero", "POST", T, tts(refine_temperature=0), 400, "refine_temperature"),
    ("refine-text-not-bool", "POST", T, tts(refine_text="maybe"), 400, "refine_text"),
    ("prompt-too-long", "POST", T, tts(prompt="[speed_5]" * 40), 400, "prompt"),
    ("prompt-unknown-token", "POST", T, tts(prompt="[speed_99]"), 400, None),
    ("lang-unknown", "POST", T, tts(lang="fr"), 400, "lang"),
    ("unknown-voice", "POST", S, speech(voice="no-such-voice"), 400, "unknown_voice"),
    ("unknown-voice-tts", "POST", T, tts(voice="no-such-voice"), 400, "unknown_voice"),
    ("bad-speaker-string", "POST", T, tts(speaker="not a speaker"), 400, None),
    ("bad-speaker-base16384", "POST", T, tts(speaker="\u4e00" * 20), 400, None),
    ("unknown-response-format", "POST", S, speech(response_format="ogg"), 400, "response_format"),
    ("unknown-format-tts", "POST", T, tts(format="wma"), 400, "format"),
    ("unknown-stream-format", "POST", S, speech(stream_format="chunks"), 400, "stream_format"),
    ("unknown-model", "POST", S, speech(model="tts-9000"), 400, "model_not_found"),
    ("unknown-extra-field", "POST", S, speech(foo=1), 400, "foo"),
    ("unknown-extra-field-tts", "POST", T, tts(bit_rate=16000), 400, "bit_rate"),
    # In the text an unknown [tag] is spoken as text (as in the reference); in a prompt it is refused.
    ("unknown-control-token", "POST", S, speech(prompt="[speed_5][foo]"), 400, None),
    ("unknown-control-token-tts", "POST", T, tts(refine_prompt="[laugh_9000]"), 400, None),
    ("stream-not-bool", "POST", T, tts(stream="sometimes"), 400, "stream"),
    ("chunking-bad-policy", "POST", T, tts(chunking={"lookahead": 1, "crossfade": 10000}), 400, "chunking"),
    ("chunking-first-over-max", "POST", T, tts(chunking={"first_chunk": 64, "max_chunk": 8}), 400, "chunking"),
    ("chunking-unknown-key", "POST", T, tts(chunking={"size": 3}), 400, "chunking.size"),
    ("chunking-not-object", "POST", T, tts(chunking=[1, 2]), 400, "chunking"),
    ("non-utf8-body", "POST", S, raw(b'{"model": "tts-1", "voice": "alloy", "input": "\xff\xfe\xfd"}'), 400, None),
    ("invalid-json", "POST", S, raw('{"model": "tts-1", "input": '), 400, None),
    ("invalid-json-tts", "POST", T, raw("{'text': 'single quotes'}"), 400, None),
    ("json-array", "POST", S, {"json": [SPEECH]}, 400, None),
    ("json-string", "POST", T, {"json": "hello"}, 400, None),
    ("json-null", "POST", S, raw("null"), 400, None),
    ("empty-body", "POST", S, raw(b""), 400, None),
    ("huge-body", "POST", S, raw(json.dumps({**SPEECH, "input": "x" * (1 << 20)})), 413, "too_large"),
    ("huge-body-voices", "POST", V, raw(b"{" + b" " * (1 << 20) + b"}"), 413, "too_large"),
    ("text-plain-content-type", "POST", S, raw(json.dumps(SPEECH), {"content-type": "text/plain"}), 400, None),
    ("form-content-type", "POST", S, {"data": {"model": "tts-1", "voice": "alloy", "input": "hi"}}, 400, None),
    ("get-speech", "GET", S, {}, 405, None),
    ("put-tts", "PUT", T, {}, 405, None),
    ("delete-models", "DELETE", "/v1/models", {}, 405, None),
    ("post-health", "POST", "/health", {}, 405, None),
    ("unknown-path", "GET", "/v1/nothing-here", {}, 404, None),
    ("unknown-path-post", "POST", "/v1/audio/transcriptions", {"json": {}}, 404, None),
    ("unknown-voice-get", "GET", V + "/no-such-voice", {}, 404, "voice_not_found"),
    ("unknown-voice-delete", "DELETE", V + "/no-such-voice", {}, 404, "voice_not_found"),
    ("voice-bad-name", "POST", V, {"json": {"name": "bad name!", "seed": 1}}, 400, None),
    ("voice-name-too-long", "POST", V, {"json": {"name": "x" * 65, "seed": 1}}, 400, None),
    ("voice-both-speaker-and-seed", "POST", V, {"json": {"name": "both", "seed": 1, "speaker": "x"}}, 400, None),
    ("voice-neither", "POST", V, {"json": {"name": "neither"}}, 400, None),
    ("voice-bad-speaker", "POST", V, {"json": {"name": "badspk", "speaker": "abc"}}, 400, "speaker"),
    ("voice-seed-negative", "POST", V, {"json": {"name": "neg", "seed": -3}}, 400, None),
    ("voice-extra-field", "POST", V, {"json": {"name": "extra", "seed": 1, "gender": "f"}}, 400, None),
    ("voice-json-array", "POST", V, {"json": ["name", "seed"]}, 400, None),
    ("voice-invalid-json", "POST", V, raw("{name: x}"), 400, None),
    ("voice-duplicate", "POST", V, {"json": {"name": DUP, "seed": 2}}, 409, "voice_exists"),
    ("upload-not-audio", "POST", V, junk_upload(), 400, "file"),
    (
        "upload-text-file",
        "POST",
        V,
        {"data": {"name": "txt", "text": "hi"}, "files": {"file": ("a.txt", b"hello " * 200, "text/plain")}},
        400,
        "file",
    ),
    (
        "upload-no-file",
        "POST",
        V,
        {"data": {"name": "nofile", "text": "hi"}, "files": {"other": ("a", b"b")}},
        400,
        "file",
    ),
    ("upload-bad-name", "POST", V, junk_upload(name="a b"), 400, "name"),
]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, timeout=HTTP_TIMEOUT) as c:
        r = c.post("/v1/voices", json={"name": DUP, "seed": 1})
        assert r.status_code == 201, r.text
        yield c
        assert c.delete(f"/v1/voices/{DUP}").status_code == 200


def test_table_is_big_enough():
    assert len(CASES) >= 30
    assert len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_request(http, case):
    _, method, path, kwargs, status, expect = case
    kwargs = dict(kwargs)
    headers = {"X-Request-ID": "bad-req-1", **kwargs.pop("headers", {})}
    r = http.request(method, path, headers=headers, **kwargs)
    err = check_openai_error(r, status)
    assert r.headers.get("x-request-id") == "bad-req-1"
    if expect is not None:
        assert expect in (err["param"], err["code"]), err
    if status == 400:
        assert err["type"] == "invalid_request_error"


def test_server_still_healthy(http):
    assert http.get("/health").status_code == 200
    assert http.get("/ready").status_code == 200
    r = http.post("/v1/audio/speech", json=SPEECH)
    assert r.status_code == 200 and len(r.content) == 2 * expected_samples(8)
    r = http.post("/v1/tts", json=TTS)
    assert r.status_code == 200 and len(r.content) == 2 * expected_samples(8)
    names = {v["name"] for v in http.get(V).json()["data"]}
    assert DUP in names
    attempted = {c[3]["json"]["name"] for c in CASES if c[2] == V and isinstance(c[3].get("json"), dict)}
    attempted |= {c[3]["data"]["name"] for c in CASES if c[2] == V and "data" in c[3]}
    assert not (attempted - {DUP}) & names  # no bad request created a voice


def test_chunked_body_over_the_limit_is_413(server):
    """A body without Content-Length (chunked) is limited too."""

    def body():
        for _ in range(32):
            yield b" " * 65536  # 2 MiB of whitespace, then a valid request
        yield b'{"model":"tts-1","voice":"alloy","input":"hi","response_format":"pcm","max_new_tokens":4}'

    r = httpx.post(
        server + "/v1/audio/speech", content=body(), headers={"content-type": "application/json"}, timeout=60
    )
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "too_large"
    assert httpx.get(server + "/health", timeout=10).status_code == 200
