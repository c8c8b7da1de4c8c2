"""A real server process on 127.0.0.1 with a tiny random checkpoint, driven over real HTTP/WebSocket.

Besides the fixtures, this module holds small helpers the server tests share (import them with
``from .conftest import ...``): audio decoding (PyAV), Ogg page parsing, Prometheus metric reading and
the OpenAI error-shape check.
"""

from __future__ import annotations

import io
import os
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.support.servers import (  # noqa: F401 - moved to tests/support; the server tests import them from here
    STARTUP_TIMEOUT,
    InProcessServer,
    app_config,
    check_openai_error,
    free_port,
    serving,
    wait_until,
)

SR = 24000
HTTP_TIMEOUT = 60


@dataclass
class ServerProcess:
    base: str
    proc: subprocess.Popen | None
    log_path: Path
    stop: Callable[[], int | None]
    """Stops the server (a process: SIGTERM, its exit status; in-process: after uvicorn's shutdown, None)."""

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def _api_key(extra: tuple[str, ...]) -> str | None:
    """The first key of ``--api-keys a,b`` (the readiness probe must authenticate)."""
    for i, arg in enumerate(extra):
        if arg == "--api-keys" and i + 1 < len(extra):
            return extra[i + 1].split(",")[0].strip()
        if arg.startswith("--api-keys="):
            return arg.split("=", 1)[1].split(",")[0].strip()
    return None


def server_flags(ckpt: Path, tmp: Path, port: int, *extra: str) -> list[str]:
    """``chattts-serve serve``'s flags for a test server; those in ``extra`` win over these defaults."""
    return [
        "--model", str(ckpt), "--port", str(port), "--host", "127.0.0.1",
        "--voices-db", str(tmp / "voices.sqlite3"), "--threads", "1", "--log-level", "warning",
        # No result cache unless a test asks for one: a repeated seeded request must reach the engine, or a
        # "same seed, same bytes" check would compare a copy with itself.
        "--cache-mb", "0", *extra,
    ]  # fmt: skip


def _wait_ready(base: str, headers: dict[str, str], alive: Callable[[], None]) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while True:
        alive()
        try:
            if httpx.get(base + "/ready", headers=headers, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("server did not become ready")
        time.sleep(0.2)


@contextmanager
def start_server(
    ckpt: Path, tmp: Path, *extra: str, env: dict[str, str] | None = None, in_process: bool = False
) -> Iterator[ServerProcess]:
    """Start ``chattts-serve serve`` with ``extra`` flags; yields a ServerProcess once /ready answers 200;
    stops it after.

    By default a real process (SIGTERM, then SIGKILL): for what only a process shows (signals, exit codes,
    its log, the CLI). ``in_process=True`` serves the same flags from this process instead, with the same
    app and uvicorn settings (``run.uvicorn_config``) in a thread: no interpreter, torch and model start
    per server, and the fast test tier can use it; ``proc`` is then None and the log is not captured."""
    port = free_port()
    flags = server_flags(ckpt, tmp, port, *extra)
    base = f"http://127.0.0.1:{port}"
    key = _api_key(extra)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if in_process:
        assert env is None, "an in-process server shares this process's environment"
        with _in_process(flags) as srv:
            _wait_ready(base, headers, srv.alive)
            yield ServerProcess(base, None, tmp / f"server-{port}.log", srv.stop)
        return
    cmd = [sys.executable, "-m", "chattts_serve.cli", "serve", *flags]
    log_path = tmp / f"server-{port}.log"
    log = open(log_path, "w")  # noqa: SIM115 - closed below
    proc_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=proc_env)

    def alive() -> None:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {log_path.read_text()}")

    def stop() -> int:
        proc.terminate()
        return proc.wait(timeout=30)

    try:
        _wait_ready(base, headers, alive)
        yield ServerProcess(base, proc, log_path, stop)
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        log.close()


@contextmanager
def _in_process(flags: list[str]) -> Iterator[InProcessServer]:
    """The app of ``serve FLAGS``, served by ``serving``."""
    import argparse

    from chattts_serve.server.app import create_app
    from chattts_serve.server.config import ServerConfig, add_server_arguments

    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    config = ServerConfig.from_args(parser.parse_args(flags), environ={})
    with serving(create_app(config), config) as srv:
        yield srv


@contextmanager
def running_server(
    ckpt: Path, tmp: Path, *extra: str, env: dict[str, str] | None = None, in_process: bool = False
) -> Iterator[str]:
    """``start_server``, yielding only the base URL."""
    with start_server(ckpt, tmp, *extra, env=env, in_process=in_process) as srv:
        yield srv.base


@pytest.fixture(scope="session")
def server(tiny_ckpt, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("server")
    with running_server(
        tiny_ckpt, tmp, "--max-num-seqs", "4", "--max-concurrent-streams", "16", in_process=True
    ) as base:
        yield base


# --------------------------------------------------------------------------------------------- helpers


def tts_body(tokens: int, text: str = "今天天气真不错。", **extra) -> dict:
    """A native /v1/tts body of a fixed length (min = max = ``tokens``), seeded, refine off."""
    return {
        "text": text,
        "format": "pcm",
        "seed": 1,
        "refine_text": False,
        "min_new_tokens": tokens,
        "max_new_tokens": tokens,
        **extra,
    }


@pytest.fixture(scope="module")
def http(server):
    """An HTTP client on the shared server."""
    with httpx.Client(base_url=server, timeout=HTTP_TIMEOUT) as c:
        yield c


def ws_url(base: str, query: str = "") -> str:
    return base.replace("http://", "ws://") + "/v1/tts/stream" + query


def expected_samples(tokens: int, segments: int = 1) -> int:
    """Samples of ``tokens`` audio tokens per text segment (512 per token, minus half a token)."""
    return segments * (512 * tokens - 256)


def decode_audio(data: bytes, fmt: str) -> tuple[np.ndarray, int]:
    """Decode a whole response body: (mono samples, sample rate). pcm is raw s16le mono 24 kHz."""
    if fmt == "pcm":
        assert len(data) % 2 == 0, "pcm body has an odd number of bytes"
        return np.frombuffer(data, dtype="<i2"), SR
    import av

    parts, rate = [], None
    with av.open(io.BytesIO(data), mode="r") as container:
        assert len(container.streams.audio) == 1, "expected exactly one audio stream"
        stream = container.streams.audio[0]
        for frame in container.decode(stream):
            rate = frame.sample_rate
            parts.append(frame.to_ndarray().reshape(-1))
    assert parts, f"{fmt}: no audio frames decoded"
    return np.concatenate(parts), rate


def ogg_pages(data: bytes) -> list[tuple[int, int, bytes]]:
    """Parse an Ogg byte stream into pages: (header_type, serial, payload). Asserts that the pages
    cover the whole body, with no junk in between or after."""
    pages, pos = [], 0
    while pos < len(data):
        assert data[pos : pos + 4] == b"OggS", f"no Ogg page at byte {pos}"
        header_type = data[pos + 5]
        serial = struct.unpack_from("<I", data, pos + 14)[0]
        nseg = data[pos + 26]
        lacing = data[pos + 27 : pos + 27 + nseg]
        start = pos + 27 + nseg
        end = start + sum(lacing)
        assert end <= len(data), "truncated Ogg page"
        pages.append((header_type, serial, data[start:end]))
        pos = end
    return pages


def check_one_ogg_opus_stream(data: bytes) -> int:
    """Exactly one logical Ogg stream (one BOS page first, one EOS page last, one serial) carrying
    Opus; returns the OpusHead input sample rate field."""
    pages = ogg_pages(data)
    assert len(pages) >= 3
    assert len({serial for _, serial, _ in pages}) == 1, "more than one Ogg stream"
    bos = [i for i, (h, _, _) in enumerate(pages) if h & 0x02]
    eos = [i for i, (h, _, _) in enumerate(pages) if h & 0x04]
    assert bos == [0], f"BOS pages at {bos}"
    assert eos == [len(pages) - 1], f"EOS pages at {eos}"
    head = pages[0][2]
    assert head[:8] == b"OpusHead"
    assert head[9] == 1, "expected mono"
    assert pages[1][2][:8] == b"OpusTags"
    return struct.unpack_from("<I", head, 12)[0]


def check_streamed_wav(data: bytes, samples: int | None = None) -> None:
    """One open-ended wav header (sizes 0xFFFFFFFF) followed by PCM16 mono 24 kHz."""
    assert data[:4] == b"RIFF" and data[8:16] == b"WAVEfmt "
    assert data.count(b"RIFF") == 1 and data.count(b"WAVEfmt ") == 1, "more than one wav header"
    _, fmt_tag, channels, rate, byte_rate, align, bits = struct.unpack_from("<IHHIIHH", data, 16)
    assert (fmt_tag, channels, rate, byte_rate, align, bits) == (1, 1, SR, 2 * SR, 2, 16)
    assert data[36:40] == b"data"
    if samples is not None:
        assert len(data) - 44 == 2 * samples


def metrics_text(base: str, headers: dict[str, str] | None = None) -> str:
    r = httpx.get(base + "/metrics", headers=headers, timeout=HTTP_TIMEOUT)
    assert r.status_code == 200, r.text
    return r.text


def metric(base: str, name: str, labels: dict[str, str] | None = None, *, text: str | None = None) -> float:
    """One sample's value from /metrics (0.0 when the series does not exist yet)."""
    text = metrics_text(base) if text is None else text
    want = labels or {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        series, _, rest = key.partition("{")
        if series != name:
            continue
        got = {}
        if rest:
            for item in rest.rstrip("}").split(","):
                if item:
                    k, _, v = item.partition("=")
                    got[k] = v.strip('"')
        if got == want:
            return float(value)
    return 0.0


