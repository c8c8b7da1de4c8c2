"""A real server process on 127.0.0.1 with a tiny random checkpoint, driven over real HTTP/WebSocket."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

STARTUP_TIMEOUT = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(ckpt: Path, tmp: Path, *extra: str, env: dict[str, str] | None = None):
    """Start ``chattts-serve serve`` in a subprocess; yields its base URL; stops it (SIGTERM) after."""
    port = free_port()
    cmd = [sys.executable, "-m", "chattts_serve.cli", "serve", "--model", str(ckpt), "--port", str(port),
           "--host", "127.0.0.1", "--voices-db", str(tmp / "voices.sqlite3"), "--threads", "1",
           "--log-level", "warning", *extra]
    log = open(tmp / f"server-{port}.log", "w")  # noqa: SIM115 - closed below
    proc_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=proc_env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}: {(tmp / f'server-{port}.log').read_text()}")
            try:
                if httpx.get(base + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("server did not become ready")
            time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()


@pytest.fixture(scope="session")
def server(tiny_ckpt, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("server")
    with running_server(tiny_ckpt, tmp, "--max-num-seqs", "4", "--max-concurrent-streams", "16") as base:
        yield base
