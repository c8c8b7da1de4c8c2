"""Clients that hold capacity without using it, and requests that ask too much: a reader that stalls,
a client that leaves while queued, a request that asks for hours of audio, duplicate X-Request-IDs,
a foreign Host header. Each is bounded by a setting; capacity comes back."""

from __future__ import annotations

import base64
import json
import os
import socket
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from .conftest import (
    HTTP_TIMEOUT,
    app_config,
    check_openai_error,
    expected_samples,
    free_port,
    metric,
    serving,
    start_server,
    tts_body,
    wait_until,
)

pytestmark = pytest.mark.integration

TEXT = "今天天气真不错。"


@pytest.fixture(scope="module")
def srv(tiny_ckpt, tmp_path_factory):
    """One KV slot; a short send timeout; an audio budget of 300 s; one allowed host name."""
    tmp = tmp_path_factory.mktemp("slow")
    flags = ["--max-num-seqs", "1", "--send-timeout-s", "2", "--max-audio-seconds", "300"]
    flags += ["--max-buffered-audio-s", "1000", "--allowed-hosts", "127.0.0.1,localhost"]
    with start_server(tiny_ckpt, tmp, *flags, "--no-warmup", "--log-level", "info") as s:
        yield s


def _stalled_socket(port: int) -> socket.socket:
    """A client socket with a 4 KiB receive buffer (set before connecting, so the window stays small)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(HTTP_TIMEOUT)
    sock.connect(("127.0.0.1", port))  # (every server here listens on 127.0.0.1)
    return sock


def _raw_request(base: str, path: str, payload: dict) -> socket.socket:
    """An HTTP/1.1 request on a socket with a tiny receive buffer, whose reader then stops reading."""
    host, port = base.removeprefix("http://").split(":")
    sock = _stalled_socket(int(port))
    data = json.dumps(payload).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    assert sock.recv(1024).startswith(b"HTTP/1.1 200")  # the response has started ... and then nobody reads
    return sock


def test_a_reader_that_stalls_is_cut_off_and_its_slot_freed(srv):
    aborted = metric(srv.base, "chattts_aborted_requests_total")
    # Three sentences of 2000 steps: 6 MB of WAV, more than the socket buffers on both sides hold.
    text = "今天天气真不错。我们去公园吧。明天见。"
    options = {"seed": 1, "refine_text": False, "min_new_tokens": 2000, "max_new_tokens": 2000}
    speech = {"model": "tts-1", "voice": "alloy", "input": text, "response_format": "wav", **options}
    sock = _raw_request(srv.base, "/v1/audio/speech", {**speech, "first_sentence_voice": False})
    try:
        assert wait_until(lambda: metric(srv.base, "chattts_aborted_requests_total") == aborted + 1, timeout=60)
        assert wait_until(lambda: metric(srv.base, "chattts_kv_slots_used") == 0, timeout=30)
        assert metric(srv.base, "chattts_requests_in_flight") == 0
    finally:
        sock.close()
    assert "client read nothing for 2 s" in srv.log()  # cut by the send timeout
    r = httpx.post(srv.base + "/v1/tts", json={**tts_body(20), "stream": False}, timeout=HTTP_TIMEOUT)
    assert r.status_code == 200 and len(r.content) == 2 * expected_samples(20)


def test_a_client_that_leaves_while_queued_aborts_its_request(srv):
    base = srv.base
    aborted = metric(base, "chattts_aborted_requests_total")
    with httpx.Client(timeout=HTTP_TIMEOUT) as c:
        with c.stream("POST", base + "/v1/tts", json=tts_body(2000)) as holder:  # holds the only slot
            chunks = holder.iter_raw()
            assert next(chunks)
            speech = {"model": "tts-1", "voice": "alloy", "input": TEXT, "response_format": "pcm", **tts_body(20)}
            del speech["text"], speech["format"]
            host, port = base.removeprefix("http://").split(":")
            with socket.create_connection((host, int(port)), timeout=HTTP_TIMEOUT) as sock:
                data = json.dumps(speech).encode()
                sock.sendall(
                    f"POST /v1/audio/speech HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(data)}\r\n\r\n".encode()
                    + data
                )
                assert wait_until(lambda: metric(base, "chattts_queue_depth") == 1, timeout=30)
            # The client is gone while its request waits for the slot: the request leaves the queue.
            assert wait_until(lambda: metric(base, "chattts_queue_depth") == 0, timeout=30)
            assert wait_until(lambda: metric(base, "chattts_aborted_requests_total") >= aborted + 1, timeout=30)
    assert wait_until(lambda: metric(base, "chattts_kv_slots_used") == 0, timeout=60)


def test_a_request_over_the_audio_budget_is_refused(srv):
    many = "\n".join(f"第{i}行。" for i in range(100))  # 100 sentences x 2000 tokens = ~71 min asked
    r = httpx.post(srv.base + "/v1/tts", json={**tts_body(2000), "text": many, "stream": False}, timeout=HTTP_TIMEOUT)
    err = check_openai_error(r, 400)
    assert "the limit is 300 s" in err["message"]


def test_requests_with_the_same_client_id_both_run(srv):
    def one(_):
        return httpx.post(
            srv.base + "/v1/tts",
            json={**tts_body(12), "stream": False},
            headers={"X-Request-ID": "same"},
            timeout=HTTP_TIMEOUT,
        )

    with ThreadPoolExecutor(2) as pool:
        responses = list(pool.map(one, range(2)))
    assert [r.status_code for r in responses] == [200, 200]
    assert all(r.headers["x-request-id"] == "same" for r in responses)
    weird = httpx.get(srv.base + "/health", headers={"X-Request-ID": "x" * 500}, timeout=HTTP_TIMEOUT)
    assert weird.headers["x-request-id"] != "x" * 500  # not echoed: too long for logs and headers


def test_a_foreign_host_header_is_refused(srv):
    r = httpx.get(srv.base + "/v1/models", headers={"Host": "evil.example"}, timeout=HTTP_TIMEOUT)
    check_openai_error(r, 400)
    assert httpx.get(srv.base + "/v1/models", timeout=HTTP_TIMEOUT).status_code == 200


# ----------------------------------------------------------------------------------- stalled readers, every transport


@pytest.fixture(scope="module")
def one_stream(tiny_ckpt, tmp_path_factory):
    """In process: HTTP, WebSocket and Wyoming on one engine, one stream at a time, a send timeout of 1 s; the
    engine keeps any amount of unread audio (only the send timeout can free a stalled stream's slot)."""
    from chattts_serve.engine.async_engine import AsyncEngine
    from chattts_serve.engine.config import EngineConfig
    from chattts_serve.server.app import create_app

    wyoming_port = free_port()
    config = app_config(
        tiny_ckpt,
        tmp_path_factory.mktemp("stall"),
        max_concurrent_streams=1,
        send_timeout_s=1,
        max_buffered_audio_s=1000,
        wyoming_uri=f"tcp://127.0.0.1:{wyoming_port}",
    )
    engine = AsyncEngine.from_pretrained(tiny_ckpt, "cpu", EngineConfig.with_slots(2), max_buffered_audio_s=1000)
    with serving(create_app(config, engine=engine)) as srv:
        yield srv.base, wyoming_port


# Three sentences of 2000 steps: 6 MB of PCM, far more than the socket buffers on both sides hold.
_LONG = "今天天气真不错。我们去公园吧。明天见。"
_LONG_OPTIONS = {
    "seed": 1,
    "refine_text": False,
    "min_new_tokens": 2000,
    "max_new_tokens": 2000,
    "first_sentence_voice": False,
}


def _stall_http(base: str, _wyoming_port: int) -> socket.socket:
    return _raw_request(base, "/v1/tts", {**_LONG_OPTIONS, "text": _LONG, "format": "pcm"})


def _ws_frame(text: str) -> bytes:
    """A masked text frame (a client's frames must be masked)."""
    payload, mask = text.encode(), os.urandom(4)
    n = len(payload)
    size = bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + n.to_bytes(2, "big")
    return bytes([0x81]) + size + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def _stall_websocket(base: str, _wyoming_port: int) -> socket.socket:
    sock = _stalled_socket(int(base.rsplit(":", 1)[1]))
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall(
        f"GET /v1/tts/stream HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode()
    )
    assert sock.recv(1024).startswith(b"HTTP/1.1 101")
    start = {"type": "start", "format": "pcm", **_LONG_OPTIONS}
    sock.sendall(_ws_frame(json.dumps(start)) + _ws_frame(json.dumps({"type": "text", "text": _LONG})))
    sock.sendall(_ws_frame(json.dumps({"type": "end"})))
    return sock


def _stall_wyoming(_base: str, wyoming_port: int) -> socket.socket:
    sock = _stalled_socket(wyoming_port)
    data = json.dumps({"text": _LONG, "chattts": _LONG_OPTIONS}).encode()
    header = {"type": "synthesize", "data_length": len(data)}
    sock.sendall(json.dumps(header).encode() + b"\n" + data)
    return sock


@pytest.mark.parametrize("stall", [_stall_http, _stall_websocket, _stall_wyoming], ids=["http", "ws", "wyoming"])
def test_a_reader_that_stalls_frees_its_slot_on_every_transport(one_stream, stall):
    """A client that stops reading is cut off within the send timeout and its slot comes back, whichever
    transport it came by. Without a deadline on the WebSocket's sends, one such client held the only slot
    (and every new request got 429) for as long as it kept the connection open."""
    base, wyoming_port = one_stream
    aborted = metric(base, "chattts_aborted_requests_total")
    sock = stall(base, wyoming_port)
    try:
        assert wait_until(lambda: metric(base, "chattts_aborted_requests_total") == aborted + 1, timeout=90)
        assert wait_until(lambda: metric(base, "chattts_requests_in_flight") == 0, timeout=10)
        r = httpx.post(base + "/v1/tts", json={**tts_body(20), "stream": False}, timeout=HTTP_TIMEOUT)
        assert r.status_code == 200 and len(r.content) == 2 * expected_samples(20)
    finally:
        sock.close()


# ----------------------------------------------------------------------------------- slow requests


@pytest.fixture(scope="module")
def deadlines(tiny_ckpt, tmp_path_factory):
    """Short header and body deadlines; room for four connections only."""
    tmp = tmp_path_factory.mktemp("deadlines")
    flags = ["--header-timeout-s", "1", "--body-timeout-s", "2", "--max-connections", "4"]
    with start_server(tiny_ckpt, tmp, *flags, "--no-warmup") as s:
        yield s


class RawConnection:
    """A client socket whose reads poll, keeping what the server sent."""

    def __init__(self, base: str) -> None:
        host, port = base.removeprefix("http://").split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=HTTP_TIMEOUT)
        self.sock.settimeout(0.2)
        self.received = b""

    def closed_by_server(self) -> bool:
        try:
            while chunk := self.sock.recv(4096):
                self.received += chunk
            return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            return False


def test_slowloris_headers_are_cut_and_capacity_comes_back(deadlines):
    """Four connections (the server's whole allowance) trickle header bytes: the header deadline closes
    them without an answer, and the server serves again. Without a deadline they stay open for good."""
    conns = [RawConnection(deadlines.base) for _ in range(4)]
    try:
        for c in conns:
            c.sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        # A byte now and then keeps uvicorn's own keep-alive timer off: only the header deadline helps.
        for c in conns:
            c.sock.sendall(b"a")
        assert wait_until(lambda: all(c.closed_by_server() for c in conns), timeout=60)
        assert not any(c.received for c in conns)  # closed without an answer
    finally:
        for c in conns:
            c.sock.close()
    assert wait_until(lambda: httpx.get(deadlines.base + "/health", timeout=10).status_code == 200, timeout=30)


def test_headers_sent_in_time_are_served(deadlines):
    """The deadline covers the headers only: a request whose headers came in time is not cut, and a
    kept-alive connection gets a fresh deadline for its next request."""
    with httpx.Client(base_url=deadlines.base, timeout=HTTP_TIMEOUT) as client:
        first = client.post("/v1/tts", json={**tts_body(200), "stream": False})  # longer than the deadline
        second = client.get("/health")
    assert first.status_code == 200 and len(first.content) == 2 * expected_samples(200)
    assert second.status_code == 200


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_that_stalls_gets_408(deadlines, chunked):
    conn = RawConnection(deadlines.base)
    head = "POST /v1/tts HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    try:
        if chunked:
            conn.sock.sendall((head + 'Transfer-Encoding: chunked\r\n\r\n5\r\n{"tex\r\n').encode())
        else:
            conn.sock.sendall((head + 'Content-Length: 100\r\n\r\n{"text": ').encode())
        assert wait_until(conn.closed_by_server, timeout=60)
        status_line, _, rest = conn.received.partition(b"\r\n")
        assert status_line == b"HTTP/1.1 408 Request Timeout"
        assert json.loads(rest.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "body_timeout"
    finally:
        conn.sock.close()
    assert httpx.post(deadlines.base + "/v1/tts", json={**tts_body(8), "stream": False}, timeout=60).status_code == 200
