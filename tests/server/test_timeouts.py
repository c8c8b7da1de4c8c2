"""The header deadline (``timeouts.protocol_with_header_timeout``) against the requests it must leave alone:
pipelined ones. (Slowloris clients it must cut are in test_slow_clients.py.)"""

from __future__ import annotations

import json
import socket
import time

import pytest

from .conftest import HTTP_TIMEOUT, expected_samples, start_server, tts_body

DEADLINE_S = 0.5
TOKENS = 2000  # 2 MB of PCM: far more than the socket buffers hold


@pytest.fixture(scope="module")
def short_deadline(tiny_ckpt, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("header-deadline")
    with start_server(tiny_ckpt, tmp, "--header-timeout-s", str(DEADLINE_S), "--no-warmup", in_process=True) as s:
        yield s


def _read_response(sock: socket.socket, buffer: bytes) -> tuple[bytes, bytes, bytes]:
    """One HTTP/1.1 response (Content-Length or chunked) from ``sock``: (head, body, bytes left over)."""

    def more() -> bytes:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed by the server after {len(buffer)} bytes")
        return chunk

    while b"\r\n\r\n" not in buffer:
        buffer += more()
    head, buffer = buffer.split(b"\r\n\r\n", 1)
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(b":") for line in head.split(b"\r\n")[1:])}
    if b"content-length" in headers:
        size = int(headers[b"content-length"])
        while len(buffer) < size:
            buffer += more()
        return head, buffer[:size], buffer[size:]
    assert headers.get(b"transfer-encoding") == b"chunked", head
    body = b""
    while True:
        while b"\r\n" not in buffer:
            buffer += more()
        size_line, buffer = buffer.split(b"\r\n", 1)
        size = int(size_line, 16)
        while len(buffer) < size + 2:
            buffer += more()
        body, buffer = body + buffer[:size], buffer[size + 2 :]
        if size == 0:
            return head, body, buffer


def test_a_pipelined_stream_outlives_the_header_deadline(short_deadline):
    """Two requests sent at once on one connection (HTTP/1.1 pipelining): ``GET /health``, then a stream that
    lasts longer than the header deadline. The deadline guards only a connection waiting for headers: the
    second request's headers were in before the first response ended, so its stream runs to the end (it
    was cut at the deadline when the deadline was re-armed at the end of every response)."""
    host, port = short_deadline.base.removeprefix("http://").split(":")
    data = json.dumps(tts_body(TOKENS)).encode()  # streamed (the native default)
    requests = (
        f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n"
        f"POST /v1/tts HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode() + data
    with socket.socket() as sock:
        # A small receive buffer and a pause before reading the stream: the response is still being sent
        # three deadlines after its headers came in, however fast the engine is (no timing assumption).
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
        sock.settimeout(HTTP_TIMEOUT)
        sock.connect((host, int(port)))
        sock.sendall(requests)
        head, body, rest = _read_response(sock, b"")
        assert head.startswith(b"HTTP/1.1 200") and json.loads(body) == {"status": "ok"}
        time.sleep(3 * DEADLINE_S)
        head, audio, rest = _read_response(sock, rest)
    assert head.startswith(b"HTTP/1.1 200"), head
    assert len(audio) == 2 * expected_samples(TOKENS) and not rest
