"""The native API: ``POST /v1/tts`` (streamed and whole) and the WebSocket ``/v1/tts/stream``."""

from __future__ import annotations

import json
import struct
import time

import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from .conftest import HTTP_TIMEOUT, SR, check_openai_error, check_streamed_wav, decode_audio, expected_samples

TEXT = "今天天气真不错。"
TOKENS = 40
EXPECTED = expected_samples(TOKENS)
FIXED = {"seed": 1, "refine_text": False, "min_new_tokens": TOKENS, "max_new_tokens": TOKENS}


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, timeout=HTTP_TIMEOUT) as c:
        yield c


def ws_url(base: str, query: str = "") -> str:
    return base.replace("http://", "ws://") + "/v1/tts/stream" + query


def test_tts_streams_wav_by_default(http):
    r = http.post("/v1/tts", json={"text": TEXT, **FIXED})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("audio/wav")
    assert "content-length" not in r.headers  # streamed (chunked)
    check_streamed_wav(r.content, EXPECTED)
    assert struct.unpack_from("<I", r.content, 40)[0] == 0xFFFFFFFF  # open-ended sizes while streaming
    assert struct.unpack_from("<I", r.content, 4)[0] == 0xFFFFFFFF


def test_tts_whole_wav_has_exact_header(http):
    whole = http.post("/v1/tts", json={"text": TEXT, "stream": False, **FIXED})
    assert whole.status_code == 200
    assert whole.headers["content-type"].startswith("audio/wav")
    data = whole.content
    assert int(whole.headers["content-length"]) == len(data) == 44 + 2 * EXPECTED
    assert data[:4] == b"RIFF" and data[8:16] == b"WAVEfmt " and data[36:40] == b"data"
    assert struct.unpack_from("<I", data, 4)[0] == 36 + 2 * EXPECTED
    assert struct.unpack_from("<I", data, 40)[0] == 2 * EXPECTED
    assert struct.unpack_from("<I", data, 24)[0] == SR
    samples, rate = decode_audio(data, "wav")
    assert rate == SR and len(samples) == EXPECTED
    streamed = http.post("/v1/tts", json={"text": TEXT, "stream": True, **FIXED}).content
    assert streamed[44:] == data[44:]  # same audio, only the header differs


@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac", "flac", "pcm"])
def test_tts_formats(http, fmt):
    for stream in (True, False):
        r = http.post("/v1/tts", json={"text": TEXT, "format": fmt, "stream": stream, **FIXED})
        assert r.status_code == 200, r.text
        samples, rate = decode_audio(r.content, fmt)
        assert rate in (SR, 48000)
        n24 = len(samples) * SR // rate
        assert EXPECTED <= n24 <= EXPECTED + 1105 + 1152  # see test_openai for the codec priming


def test_tts_every_parameter_accepted(http):
    body = {
        "text": TEXT,
        "format": "pcm",
        "seed": 7,
        "temperature": 0.4,
        "top_p": 0.8,
        "top_k": 15,
        "repetition_penalty": 1.1,
        "min_new_tokens": TOKENS,
        "max_new_tokens": TOKENS,
        "prompt": "[speed_3]",
        "refine_text": True,
        "refine_prompt": "[oral_2][laugh_0][break_6]",
        "refine_temperature": 0.6,
        "refine_top_p": 0.5,
        "refine_top_k": 10,
        "refine_max_new_tokens": 16,
        "do_text_normalization": True,
        "do_homophone_replacement": True,
        "lang": "zh",
        "split_text": False,
        "voice": "alloy",
        "stream": True,
        "chunking": {"first_chunk": 4, "max_chunk": 16, "left_context": 8, "lookahead": 4, "crossfade": 128},
    }
    r = http.post("/v1/tts", json=body)
    assert r.status_code == 200, r.text
    assert len(r.content) == 2 * EXPECTED
    english = {
        "text": "Hello there, 42 apples.",
        "format": "pcm",
        **FIXED,
        "do_text_normalization": False,
        "do_homophone_replacement": False,
        "lang": "en",
        "split_text": True,
        "stream": False,
    }
    r = http.post("/v1/tts", json=english)
    assert r.status_code == 200, r.text
    assert len(r.content) == 2 * EXPECTED


def test_split_text(http):
    two = "今天天气真不错。我们去公园吧。"
    split = http.post("/v1/tts", json={"text": two, "format": "pcm", **FIXED, "split_text": True})
    whole = http.post("/v1/tts", json={"text": two, "format": "pcm", **FIXED, "split_text": False})
    assert len(split.content) == 2 * expected_samples(TOKENS, segments=2)
    assert len(whole.content) == 2 * EXPECTED


def test_split_text_keeps_the_first_sentence_voice(http):
    """Several sentences: by default the first is spoken alone first and its audio is every sentence's
    voice sample (the reference's voice step); first_sentence_voice=false turns it off. Same length
    either way, different speech; a single sentence is unaffected."""
    two = "今天天气真不错。我们去公园吧。"
    body = {"text": two, "format": "pcm", **FIXED, "stream": False}
    voiced = http.post("/v1/tts", json=body)
    plain = http.post("/v1/tts", json={**body, "first_sentence_voice": False})
    assert voiced.status_code == plain.status_code == 200
    assert len(voiced.content) == len(plain.content) == 2 * expected_samples(TOKENS, segments=2)
    assert voiced.content != plain.content
    one = {"text": TEXT, "format": "pcm", **FIXED, "stream": False}
    assert (
        http.post("/v1/tts", json=one).content
        == http.post("/v1/tts", json={**one, "first_sentence_voice": False}).content
    )


def _stream_chunks(http, body) -> tuple[list[bytes], list[float]]:
    chunks, times = [], []
    t0 = time.monotonic()
    with http.stream("POST", "/v1/tts", json=body) as r:
        assert r.status_code == 200
        for chunk in r.iter_raw():
            if chunk:
                chunks.append(chunk)
                times.append(time.monotonic() - t0)
    return chunks, times


def test_tts_pcm_arrives_in_several_chunks(http):
    tokens = 300
    body = {
        "text": TEXT,
        "format": "pcm",
        "seed": 1,
        "refine_text": False,
        "min_new_tokens": tokens,
        "max_new_tokens": tokens,
    }
    chunks, times = _stream_chunks(http, body)
    assert len(b"".join(chunks)) == 2 * expected_samples(tokens)
    # the default policy emits 12, 24, 48, 96, 96, ... steps: at least 4 pieces for 300 steps
    assert len(chunks) >= 3, [len(c) for c in chunks]
    assert times[0] < times[-1]
    # a smaller chunking policy gives more (smaller) chunks and still exactly the same number of samples
    small = {**body, "chunking": {"first_chunk": 4, "max_chunk": 8, "left_context": 4, "lookahead": 2, "crossfade": 0}}
    chunks2, _ = _stream_chunks(http, small)
    assert len(b"".join(chunks2)) == 2 * expected_samples(tokens)
    assert len(chunks2) > len(chunks)


def _ws_collect(ws) -> tuple[list[dict], bytes]:
    """Receive until the end/error event: (events, PCM). Every chunk event is followed by exactly one
    binary frame of the announced size (or none when it announces 0 bytes)."""
    events, pcm = [], b""
    while True:
        msg = ws.recv(timeout=HTTP_TIMEOUT)
        assert isinstance(msg, str), "binary frame without a chunk event"
        event = json.loads(msg)
        events.append(event)
        if event["type"] == "chunk":
            if event["bytes"]:
                data = ws.recv(timeout=HTTP_TIMEOUT)
                assert isinstance(data, bytes) and len(data) == event["bytes"]
                assert len(data) == 2 * event["samples"]  # pcm
                pcm += data
        elif event["type"] in ("end", "error"):
            return events, pcm


def test_websocket_stream(server, http):
    with connect(ws_url(server), open_timeout=10, close_timeout=5) as ws:
        ws.send(json.dumps({"type": "start", "format": "pcm", "seed": 1, "refine_text": False, "max_new_tokens": 40}))
        ws.send(json.dumps({"type": "text", "text": "今天天气"}))
        ws.send(json.dumps({"type": "text", "text": "真不错。"}))
        ws.send(json.dumps({"type": "end"}))
        events, pcm = _ws_collect(ws)
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=10)
        assert ws.close_code == 1000
    start, chunks, end = events[0], events[1:-1], events[-1]
    assert start["type"] == "start" and start["format"] == "pcm" and start["sample_rate"] == SR
    assert start["session_id"]
    assert chunks and all(e["type"] == "chunk" for e in chunks)
    assert [e["index"] for e in chunks] == list(range(len(chunks)))
    assert end["type"] == "end" and end["chunks"] == len(chunks)
    samples = sum(e["samples"] for e in chunks)
    assert len(pcm) == 2 * samples
    assert end["audio_seconds"] == pytest.approx(samples / SR)
    assert samples > 0 and (samples + 256) % 512 == 0  # 512 * steps - 256
    # the pieces form one sentence: the same audio as one /v1/tts request with the same options
    ref = http.post(
        "/v1/tts", json={"text": TEXT, "format": "pcm", "seed": 1, "refine_text": False, "max_new_tokens": 40}
    )
    assert ref.content == pcm


def test_websocket_initial_text_dash_is_kept(server, http):
    """A start message may carry the first text itself; "-" is a text like any other, not "no text"."""
    options = {"format": "pcm", "seed": 1, "refine_text": False, "max_new_tokens": 40}
    with connect(ws_url(server), open_timeout=10, close_timeout=5) as ws:
        ws.send(json.dumps({"type": "start", "text": "-", **options}))
        ws.send(json.dumps({"type": "text", "text": TEXT}))
        ws.send(json.dumps({"type": "end"}))
        events, pcm = _ws_collect(ws)
    assert events[-1]["type"] == "end" and pcm
    assert pcm == http.post("/v1/tts", json={"text": "-" + TEXT, **options}).content
    assert pcm != http.post("/v1/tts", json={"text": TEXT, **options}).content  # the "-" was spoken


def test_websocket_two_sentences_and_wav(server):
    with connect(ws_url(server), open_timeout=10, close_timeout=5) as ws:
        ws.send(
            json.dumps(
                {
                    "type": "start",
                    "format": "wav",
                    "seed": 1,
                    "refine_text": False,
                    "min_new_tokens": 20,
                    "max_new_tokens": 20,
                }
            )
        )
        ws.send(json.dumps({"type": "text", "text": "今天天气真不错。我们"}))
        ws.send(json.dumps({"type": "text", "text": "去公园吧"}))
        ws.send(json.dumps({"type": "end"}))
        events, _ = _ws_collect_any(ws)
    chunks = [e for e in events if e["type"] == "chunk"]
    assert events[-1]["type"] == "end"
    assert {e["part"] for e in chunks} == {0, 1}  # one synthesis per sentence
    assert sum(e["samples"] for e in chunks) == expected_samples(20, segments=2)


def _ws_parts(server, first_sentence_voice: bool) -> dict[int, bytes]:
    start = {
        "type": "start",
        "format": "pcm",
        "seed": 3,
        "refine_text": False,
        "min_new_tokens": 20,
        "max_new_tokens": 20,
        "first_sentence_voice": first_sentence_voice,
    }
    with connect(ws_url(server), open_timeout=10, close_timeout=5) as ws:
        ws.send(json.dumps(start))
        for piece in ("今天天气真不错。", "我们去公园吧。", "明天见。"):
            ws.send(json.dumps({"type": "text", "text": piece}))
        ws.send(json.dumps({"type": "end"}))
        parts: dict[int, bytes] = {}
        while True:
            event = json.loads(ws.recv(timeout=HTTP_TIMEOUT))
            if event["type"] == "chunk" and event["bytes"]:
                parts[event["part"]] = parts.get(event["part"], b"") + ws.recv(timeout=HTTP_TIMEOUT)
            elif event["type"] in ("end", "error"):
                assert event["type"] == "end", event
                return parts


def test_websocket_later_parts_keep_the_first_part_voice(server):
    voiced, plain = _ws_parts(server, True), _ws_parts(server, False)
    assert sorted(voiced) == sorted(plain) == [0, 1, 2]
    assert voiced[0] == plain[0]  # the first part is heard as it is
    assert all(len(voiced[i]) == len(plain[i]) == 2 * expected_samples(20) for i in range(3))
    assert voiced[1] != plain[1] and voiced[2] != plain[2]  # the later ones speak with its voice


def _ws_collect_any(ws) -> tuple[list[dict], list[bytes]]:
    events, frames = [], []
    while True:
        msg = ws.recv(timeout=HTTP_TIMEOUT)
        if isinstance(msg, bytes):
            assert events and events[-1]["type"] == "chunk" and events[-1]["bytes"] == len(msg)
            frames.append(msg)
            continue
        events.append(json.loads(msg))
        if events[-1]["type"] in ("end", "error"):
            return events, frames


@pytest.mark.parametrize(
    "first",
    [
        json.dumps({"type": "text", "text": "你好。"}),
        json.dumps(["start"]),
        "not json",
        json.dumps({"type": "start", "temperature": -1}),
        json.dumps({"type": "start", "format": "ogg"}),
        json.dumps({"type": "start", "voice": "no-such-voice"}),
        json.dumps({"type": "start", "bogus": 1}),
    ],
    ids=["text-first", "list", "not-json", "bad-temperature", "bad-format", "unknown-voice", "unknown-field"],
)
def test_websocket_bad_first_message(server, first):
    with connect(ws_url(server), open_timeout=10, close_timeout=5) as ws:
        ws.send(first)
        event = json.loads(ws.recv(timeout=HTTP_TIMEOUT))
        assert event["type"] == "error" and isinstance(event["message"], str) and event["message"]
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=10)
        assert ws.close_code == 1008


def test_websocket_bad_later_message(server):
    with connect(ws_url(server), open_timeout=10, close_timeout=5) as ws:
        ws.send(json.dumps({"type": "start", "format": "pcm", "seed": 1, "refine_text": False, "max_new_tokens": 8}))
        assert json.loads(ws.recv(timeout=HTTP_TIMEOUT))["type"] == "start"
        ws.send(json.dumps({"type": "nonsense"}))
        events, _ = _ws_collect_any(ws)
        assert events[-1]["type"] == "error"
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=10)
        assert ws.close_code == 1008


def test_tts_error_shapes(http):
    check_openai_error(http.post("/v1/tts", json={"text": ""}), 400)
    err = check_openai_error(http.post("/v1/tts", json={"text": TEXT, "chunking": {"lookahead": 0}}), 400)
    assert "lookahead" in err["message"]
