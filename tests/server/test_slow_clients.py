"""Clients that hold capacity without using it, and requests that ask too much: a reader that stalls,
a client that leaves while queued, a request that asks for hours of audio, duplicate X-Request-IDs,
a foreign Host header. Each is bounded by a setting; capacity comes back."""

from __future__ import annotations

import json
import socket
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from .conftest import HTTP_TIMEOUT, check_openai_error, expected_samples, metric, start_server, tts_body, wait_until

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


def _raw_request(base: str, path: str, payload: dict) -> socket.socket:
    """An HTTP/1.1 request on a socket with a tiny receive buffer, whose reader then stops reading."""
    host, port = base.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(HTTP_TIMEOUT)
    sock.connect((host, int(port)))
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
