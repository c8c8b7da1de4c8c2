"""server/websocket.py over real WebSockets: the protocol, voices across parts, and every limit (message
size, session text, sentence cuts, backpressure, idle, binary frames, Origin/Host, failures)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from contextlib import aclosing
from dataclasses import dataclass, replace

import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from chattts_serve.engine.async_engine import EngineDeadError, EngineError
from chattts_serve.server import text_parts, websocket

from .conftest import (
    HTTP_TIMEOUT,
    SR,
    app_config,
    expected_samples,
    serving,
    wait_until,
    ws_url,
)

TEXT = "今天天气真不错。"
TOKENS = 40
EXPECTED = expected_samples(TOKENS)
FIXED = {"seed": 1, "refine_text": False, "min_new_tokens": TOKENS, "max_new_tokens": TOKENS}


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


def test_a_big_delta_goes_out_in_frames_under_a_megabyte(server, http):
    """Audio that reaches the session in one delta (here: 600 steps, one chunk by request; in practice what
    piles up while a client reads slowly) is sent in frames of at most MAX_FRAME_SAMPLES, so a client with
    websockets' default 1 MiB message limit reads it; the same PCM as an HTTP stream cut alike."""
    tokens = 600  # 12.8 s: more than two frames
    options = {**FIXED, "min_new_tokens": tokens, "max_new_tokens": tokens}
    big = {"first_chunk": tokens, "max_chunk": tokens}
    with connect(ws_url(server), open_timeout=10, close_timeout=5) as ws:  # max_size: 1 MiB (the default)
        ws.send(json.dumps({"type": "start", "text": TEXT, "format": "pcm", "chunking": big, **options}))
        ws.send(json.dumps({"type": "end"}))
        events, pcm = _ws_collect(ws)
    chunks = [e for e in events if e["type"] == "chunk"]
    assert events[-1]["type"] == "end"
    assert len(chunks) >= 3 and max(e["samples"] for e in chunks) <= websocket.MAX_FRAME_SAMPLES
    same = http.post("/v1/tts", json={"text": TEXT, "format": "pcm", "chunking": big, **options})  # streamed alike
    assert len(pcm) == 2 * expected_samples(tokens) and pcm == same.content


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


@pytest.mark.parametrize("first", [True, False], ids=["in-start", "in-text"])
def test_websocket_refuses_ssml_it_would_cut_apart(server, first):
    """Streamed text is spoken sentence by sentence, which would cut SSML's elements apart: refused, clearly."""
    ssml = '<speak>今天<break time="500ms"/>天气。真不错。</speak>'
    start = {"type": "start", **FIXED, "format": "pcm", **({"text": ssml} if first else {})}
    with connect(ws_url(server), open_timeout=10, close_timeout=5) as ws:
        ws.send(json.dumps(start))
        assert json.loads(ws.recv(timeout=HTTP_TIMEOUT))["type"] == "start"
        if not first:
            ws.send(json.dumps({"type": "text", "text": ssml[:12]}))
            ws.send(json.dumps({"type": "text", "text": ssml[12:]}))
        events, _ = _ws_collect_any(ws)
        assert events[-1]["type"] == "error" and events[-1]["code"] == "ssml_streamed", events
        assert "POST /v1/tts" in events[-1]["message"]
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=10)
        assert ws.close_code == 1008


WS_FIXED = {"format": "pcm", "seed": 1, "refine_text": False, "min_new_tokens": 4, "max_new_tokens": 4}
SMALL_CHUNKS = {"first_chunk": 4, "max_chunk": 8, "left_context": 4, "lookahead": 2, "crossfade": 0}


@dataclass
class EnginePlan:
    """How the engine misbehaves in the current test (``reset`` between tests)."""

    gate: threading.Event | None = None
    """The first request waits for it before producing anything."""
    fail: tuple[int, int, type[Exception]] | None = None
    """(request number, output number, exception): that request raises instead of giving that output."""
    calls: int = 0

    def reset(self) -> None:
        self.gate, self.fail, self.calls = None, None, 0


class CountingApp:
    """ASGI wrapper: counts the WebSocket messages the app has read (``websocket.receive``)."""

    def __init__(self, app) -> None:
        self.app, self.received = app, 0

    async def __call__(self, scope, receive, send):
        async def counted():
            message = await receive()
            if message["type"] == "websocket.receive":
                self.received += 1
            return message

        return await self.app(scope, counted if scope["type"] == "websocket" else receive, send)


@dataclass
class InProcess:
    base: str
    app: object
    counter: CountingApp
    plan: EnginePlan

    @property
    def url(self) -> str:
        return ws_url(self.base)

    def configure(self, **changes) -> None:
        """Other settings for this test only (the handler reads the config at each connection; ``ws_app``
        puts the original back)."""
        self.app.state.config = replace(self.app.state.config, **changes)


def _planned_stream(engine, plan: EnginePlan):
    real = engine.stream

    async def stream(text, params=None, **kw):
        call, plan.calls = plan.calls, plan.calls + 1
        if plan.gate is not None and call == 0:
            await asyncio.to_thread(plan.gate.wait, HTTP_TIMEOUT)
        async with aclosing(real(text, params, **kw)) as outputs:
            n = 0
            async for out in outputs:
                if plan.fail is not None and plan.fail[:2] == (call, n):
                    raise plan.fail[2]("injected failure")
                yield out
                n += 1

    return stream


@pytest.fixture(scope="module")
def inproc(tiny_ckpt, tmp_path_factory):
    from chattts_serve.engine.async_engine import AsyncEngine
    from chattts_serve.engine.config import EngineConfig
    from chattts_serve.server.app import create_app

    config = app_config(
        tiny_ckpt,
        tmp_path_factory.mktemp("ws-inproc"),
        max_input_chars=200,
        ws_max_message_bytes=2048,
        ws_max_text_chars=4000,
        ws_max_pending_sentences=2,
        ws_idle_timeout_s=3,
    )
    engine = AsyncEngine.from_pretrained(tiny_ckpt, "cpu", EngineConfig.with_slots(2))
    plan = EnginePlan()
    engine.stream = _planned_stream(engine, plan)
    app = create_app(config, engine=engine)
    counter = CountingApp(app)
    with serving(counter) as srv:
        try:
            yield InProcess(srv.base, app, counter, plan)
        finally:
            plan.reset()


@pytest.fixture
def ws_app(inproc):
    inproc.plan.reset()
    inproc.counter.received = 0
    config = inproc.app.state.config
    yield inproc
    inproc.plan.reset()  # a failing test must not leave the engine gated
    inproc.app.state.config = config


def _ws_all(ws, timeout: float = HTTP_TIMEOUT) -> tuple[list[dict], int | None]:
    """Every event until the server closes: (events, close code). Each chunk event must be followed by
    exactly the binary frame it announces, and nothing may come after a fatal error or the end."""
    events, owed = [], 0
    while True:
        try:
            msg = ws.recv(timeout=timeout)
        except ConnectionClosed:
            assert owed == 0, "closed before the announced audio"
            return events, ws.close_code
        if isinstance(msg, bytes):
            assert len(msg) == owed > 0, f"binary frame of {len(msg)} bytes, {owed} announced"
            owed = 0
            continue
        assert owed == 0, "an event where the announced audio was due"
        assert not events or events[-1]["type"] != "end" and not events[-1].get("fatal"), "a frame after the end"
        events.append(json.loads(msg))
        owed = events[-1]["bytes"] if events[-1]["type"] == "chunk" else 0


def _fatal(events: list[dict]) -> dict:
    assert events and events[-1]["type"] == "error" and events[-1]["fatal"] is True, events[-3:]
    assert not any(e["type"] == "end" for e in events)
    assert len(events[-1]["message"]) <= 400
    return events[-1]


def _start(ws, **options) -> None:
    ws.send(json.dumps({"type": "start", **WS_FIXED, **options}))
    assert json.loads(ws.recv(timeout=HTTP_TIMEOUT))["type"] == "start"


@pytest.mark.parametrize("text", ["a" * 3000, "你" * 1000], ids=["ascii", "3-byte-chars"])
def test_websocket_message_over_max_bytes_is_1009(ws_app, text):
    """ws_max_message_bytes (2048) counts UTF-8 bytes: 1000 CJK characters are 3000 bytes."""
    with connect(ws_app.url, open_timeout=10, close_timeout=5) as ws:
        _start(ws)
        ws.send(json.dumps({"type": "text", "text": text}))
        events, code = _ws_all(ws)
    assert _fatal(events)["code"] == "message_too_big" and code == 1009


def test_websocket_oversized_start_message_is_1009(ws_app):
    with connect(ws_app.url, open_timeout=10, close_timeout=5) as ws:
        ws.send(json.dumps({"type": "start", **WS_FIXED, "text": "a" * 3000}))
        events, code = _ws_all(ws)
    assert _fatal(events)["code"] == "message_too_big" and code == 1009


def test_websocket_text_per_session_is_capped(ws_app):
    """ws_max_text_chars (4000) in all, over several messages each under the message limit."""
    ws_app.configure(max_input_chars=4096)  # no sentence end and under the limit: nothing spoken
    with connect(ws_app.url, open_timeout=10, close_timeout=5) as ws:
        _start(ws)
        for _ in range(3):
            ws.send(json.dumps({"type": "text", "text": "ab " * 500}))
        events, code = _ws_all(ws)
    assert _fatal(events)["code"] == "text_limit" and code == 1008
    assert not any(e["type"] == "chunk" for e in events)


def test_websocket_long_run_without_sentence_end_is_spoken_in_pieces(ws_app):
    """500 characters without a sentence end, max_input_chars 200: three parts (cut at spaces), all spoken."""
    with connect(ws_app.url, open_timeout=10, close_timeout=5) as ws:
        _start(ws, split_text=False)
        for _ in range(5):
            ws.send(json.dumps({"type": "text", "text": "abcd " * 20}))
        ws.send(json.dumps({"type": "end"}))
        events, code = _ws_all(ws)
    assert events[-1]["type"] == "end" and code == 1000
    assert not any(e["type"] == "error" for e in events)
    assert {e["part"] for e in events if e["type"] == "chunk"} == {0, 1, 2}


class _CountingPattern:
    def __init__(self, pattern) -> None:
        self.pattern, self.calls, self.scanned = pattern, 0, 0

    def finditer(self, text, pos=0, *args):
        self.calls += 1
        self.scanned += len(text) - pos  # what the scan reads: from pos on
        return self.pattern.finditer(text, pos, *args)


def test_websocket_scans_only_new_text_for_sentence_ends(ws_app, monkeypatch):
    """200 pieces of 10 characters, no sentence end: the sentence-end scan reads each character once
    (re-scanning the whole buffer on every message would read ~200,000)."""
    counting = _CountingPattern(text_parts.SENTENCE_END)
    monkeypatch.setattr(text_parts, "SENTENCE_END", counting)
    ws_app.configure(max_input_chars=4096)
    with connect(ws_app.url, open_timeout=10, close_timeout=5) as ws:
        _start(ws)
        for _ in range(200):
            ws.send(json.dumps({"type": "text", "text": "abcdefghi "}))
        assert wait_until(lambda: ws_app.counter.received >= 201, timeout=HTTP_TIMEOUT)
    assert counting.scanned <= 2 * 200 * 10, counting.scanned


@pytest.mark.parametrize("after_start", [True, False], ids=["after-start", "first"])
def test_websocket_binary_frame_is_1003(ws_app, after_start):
    with connect(ws_app.url, open_timeout=10, close_timeout=5) as ws:
        if after_start:
            _start(ws)
        ws.send(b"\x00\x01binary")
        events, code = _ws_all(ws)
    assert _fatal(events)["code"] == "binary_frame" and code == 1003


def test_websocket_idle_session_is_closed(ws_app):
    """ws_idle_timeout_s (3): a started session that sends nothing more gets idle_timeout + 1001."""
    with connect(ws_app.url, open_timeout=10, close_timeout=5) as ws:
        _start(ws)
        events, code = _ws_all(ws, timeout=30)
    assert _fatal(events)["code"] == "idle_timeout" and code == 1001


def test_websocket_idle_clock_stops_while_speaking(ws_app):
    """Synthesis that takes longer than the idle timeout (the engine held back) does not close the session."""
    ws_app.plan.gate = threading.Event()
    with connect(ws_app.url, open_timeout=10, close_timeout=5) as ws:
        _start(ws)
        ws.send(json.dumps({"type": "text", "text": "你好。"}))
        assert wait_until(lambda: ws_app.plan.calls == 1, timeout=HTTP_TIMEOUT)
        time.sleep(ws_app.app.state.config.ws.idle_timeout_s + 1)  # past the idle timeout while speaking
        ws_app.plan.gate.set()
        ws.send(json.dumps({"type": "end"}))
        events, code = _ws_all(ws)
    assert events[-1]["type"] == "end" and code == 1000


def test_websocket_backpressure_stops_reading(ws_app):
    """A client that outruns synthesis: with the engine held back the handler reads no more than the start,
    the part being spoken, ws_max_pending_sentences (2) queued parts and the one waiting to be queued; once
    the engine goes on, every part is spoken in order and the session ends normally."""
    ws_app.plan.gate = threading.Event()
    sentences = 10
    with connect(ws_app.url, open_timeout=10, close_timeout=5) as ws:
        _start(ws, split_text=False)
        for i in range(sentences):
            ws.send(json.dumps({"type": "text", "text": f"第{i}句话。"}))
        ws.send(json.dumps({"type": "end"}))
        assert wait_until(lambda: ws_app.plan.calls == 1 and ws_app.counter.received >= 4, timeout=HTTP_TIMEOUT)
        most = 1 + 1 + 2 + 1
        # Waits for a read that must not happen (passes at once if the handler has stopped reading).
        assert not wait_until(lambda: ws_app.counter.received > most, timeout=2), ws_app.counter.received
        ws_app.plan.gate.set()
        events, code = _ws_all(ws)
    assert events[-1]["type"] == "end" and code == 1000
    parts = [e["part"] for e in events if e["type"] == "chunk"]
    assert sorted(set(parts)) == list(range(sentences)) and parts == sorted(parts)


@pytest.mark.parametrize("exc", [EngineError, EngineDeadError])
@pytest.mark.parametrize("where", [(0, 0), (1, 1)], ids=["before-first-chunk", "mid-second-part"])
def test_websocket_synthesis_failure_is_error_1011_not_end(ws_app, exc, where):
    ws_app.plan.fail = (*where, exc)
    options = {"split_text": False, "min_new_tokens": 40, "max_new_tokens": 40, "chunking": SMALL_CHUNKS}
    with connect(ws_app.url, open_timeout=10, close_timeout=5) as ws:
        _start(ws, **options)
        ws.send(json.dumps({"type": "text", "text": "今天天气真不错。"}))
        ws.send(json.dumps({"type": "text", "text": "我们去公园吧。"}))
        ws.send(json.dumps({"type": "end"}))
        events, code = _ws_all(ws)
    error = _fatal(events)
    assert code == 1011 and error["code"] in ("synthesis_failed", "engine_unavailable")
    assert "injected failure" not in error["message"]  # the cause goes to the log, not to the client
    parts = [e["part"] for e in events if e["type"] == "chunk"]
    if where == (1, 1):
        assert 0 in parts and parts.count(1) == 1  # part 0 whole, part 1 cut after its first chunk
    else:
        assert parts == []


def test_websocket_audio_is_encoded_off_the_event_loop(ws_app, monkeypatch):
    """mp3/opus encoding takes hundreds of ms per 5 s frame: done on the event loop it stalled every other
    client of the server. As HTTP does, every write and finish runs in a worker thread."""
    from chattts_serve.audio.encode import StreamingEncoder

    threads = []
    for name in ("write", "finish"):
        real = getattr(StreamingEncoder, name)

        def spy(self, *args, _real=real):
            threads.append(threading.current_thread().name)
            return _real(self, *args)

        monkeypatch.setattr(StreamingEncoder, name, spy)
    with connect(ws_app.url, open_timeout=10, close_timeout=5) as ws:
        _start(ws, format="mp3", text=TEXT)
        ws.send(json.dumps({"type": "end"}))
        events, code = _ws_all(ws)
    assert events[-1]["type"] == "end" and code == 1000
    assert len(threads) >= 2 and "ws-inproc" not in threads  # the server's event loop runs in "ws-inproc"


def test_websocket_errors_do_not_echo_the_whole_message(ws_app):
    junk = "A" * 1500
    for message in (json.dumps({"type": "nonsense", "junk": junk}), "not json " + junk):
        with connect(ws_app.url, open_timeout=10, close_timeout=5) as ws:
            _start(ws)
            ws.send(message)
            events, code = _ws_all(ws)
        error = _fatal(events)
        assert code == 1008 and "A" * 101 not in error["message"], error
    with connect(ws_app.url, open_timeout=10, close_timeout=5) as ws:
        ws.send(json.dumps({"type": "start", **WS_FIXED, **{f"bogus{i}": junk[:50] for i in range(20)}}))
        events, code = _ws_all(ws)
    assert code == 1008 and _fatal(events)["code"] == "invalid_request"


def _open_with_origin(url: str, origin: str | None) -> int:
    """The handshake's answer: 101 when the session opens (then closed by us), else the HTTP status."""
    try:
        with connect(url, origin=origin, open_timeout=10, close_timeout=5):
            return 101
    except InvalidStatus as exc:
        return exc.response.status_code


def test_websocket_origin_is_checked(ws_app):
    port = ws_app.base.rsplit(":", 1)[1]
    url = ws_app.url
    assert _open_with_origin(url, None) == 101  # not a browser
    assert _open_with_origin(url, f"http://127.0.0.1:{port}") == 101  # same origin
    for foreign in ("http://evil.example", f"http://localhost:{port}", "http://127.0.0.1:1", "null"):
        assert _open_with_origin(url, foreign) == 403, foreign
    assert ws_app.counter.received == 0  # refused before anything was read
    ws_app.configure(allowed_origins=("https://app.example",))
    assert _open_with_origin(url, "https://app.example") == 101
    assert _open_with_origin(url, f"http://127.0.0.1:{port}") == 403  # a list replaces same-origin


def test_websocket_host_allow_list_applies_to_the_handshake(ws_app):
    """allowed_hosts (DNS rebinding) refuses a handshake for another Host, as the HTTP middleware refuses requests."""
    ws_app.configure(allowed_hosts=("tts.example",))
    assert _open_with_origin(ws_app.url, None) == 403
    ws_app.configure(allowed_hosts=("127.0.0.1",))
    assert _open_with_origin(ws_app.url, None) == 101


@pytest.mark.parametrize(("fmt", "rate", "width"), [("mulaw", None, 1), ("pcm", 16000, 2)])
def test_websocket_sample_rate(server, http, fmt, rate, width):
    """The start message takes ``format`` and ``sample_rate`` as ``POST /v1/tts`` does; the start event says the
    rate, chunk events count samples at it, and the audio is the HTTP stream's."""
    options = {"format": fmt, **FIXED, **({"sample_rate": rate} if rate else {})}
    with connect(ws_url(server), open_timeout=10, close_timeout=5) as ws:
        ws.send(json.dumps({"type": "start", "text": TEXT, **options}))
        ws.send(json.dumps({"type": "end"}))
        events, audio = [], b""
        while not events or events[-1]["type"] not in ("end", "error"):
            events.append(json.loads(ws.recv(timeout=HTTP_TIMEOUT)))
            if events[-1]["type"] == "chunk" and events[-1]["bytes"]:
                data = ws.recv(timeout=HTTP_TIMEOUT)
                assert len(data) == width * events[-1]["samples"]
                audio += data
    out_rate = rate or 8000
    assert events[0]["sample_rate"] == out_rate and events[-1]["type"] == "end"
    samples = sum(e["samples"] for e in events if e["type"] == "chunk")
    assert events[-1]["audio_seconds"] == pytest.approx(samples / out_rate)
    assert audio == http.post("/v1/tts", json={"text": TEXT, **options}).content


def test_websocket_refuses_a_rate_the_format_cannot_take(server):
    with connect(ws_url(server), open_timeout=10, close_timeout=5) as ws:
        ws.send(json.dumps({"type": "start", "text": TEXT, "format": "opus", "sample_rate": 8000}))
        event = json.loads(ws.recv(timeout=HTTP_TIMEOUT))
        assert event["type"] == "error" and "opus is always encoded at 24000 Hz" in event["message"]
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=10)
        assert ws.close_code == 1008


@pytest.mark.parametrize("speed", [1.0, 0.5], ids=["plain", "stretched"])
def test_websocket_stream_audio_is_capped_per_stream(ws_app, speed):
    """ws_max_audio_seconds holds for the stream, not each part: parts of 40 steps (0.84 s, 1.69 s slowed
    down 2x) under a limit of 2.1 parts' worth: two are spoken, the third is refused before it is spoken
    (its min_new_tokens no longer fits) with an error event, and the client got at most the limit."""
    part_s = expected_samples(40) / SR / speed
    limit = 2.1 * part_s
    ws_app.configure(ws=replace(ws_app.app.state.config.ws, max_audio_seconds=limit))
    stretch = {} if speed == 1.0 else {"speed": speed, "speed_mode": "stretch"}
    with connect(ws_app.url, open_timeout=10, close_timeout=5) as ws:
        _start(ws, **{**WS_FIXED, "min_new_tokens": 40, "max_new_tokens": 40, **stretch})
        for _ in range(4):
            ws.send(json.dumps({"type": "text", "text": "你好。"}))
        events, code = _ws_all(ws)
    error = _fatal(events)
    assert error["code"] == "audio_limit" and code == 1008 and "ws_max_audio_seconds" in error["message"]
    samples = sum(e["samples"] for e in events if e["type"] == "chunk")
    assert samples == pytest.approx(2 * part_s * SR, abs=4) and samples / SR <= limit
