"""Servers for tests: an in-process app under uvicorn (``serving``), its config (``app_config``), a free port,
and the OpenAI error-shape check. Moved from tests/server/conftest.py (which re-exports them), so tests in any
directory import them as modules."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

STARTUP_TIMEOUT = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def app_config(ckpt: Path, tmp: Path, **options):
    """A ``ServerConfig`` for an in-process app on the CPU: ``ckpt``, voices in ``tmp``, no warm-up, no result
    cache (as ``server_flags``), and ``options`` (flat names, as the flags)."""
    from chattts_serve.server.config import ServerConfig

    options = {"voices_db": str(tmp / "voices.sqlite3"), "warmup": False, "cache_mb": 0, **options}
    return ServerConfig.from_flat(model=str(ckpt), device="cpu", **options)


@dataclass
class InProcessServer:
    base: str
    alive: Callable[[], None]
    """Raises if the server thread died."""
    stop: Callable[[], None]


@contextmanager
def serving(app, config=None) -> Iterator[InProcessServer]:
    """``app`` under uvicorn in a daemon thread on 127.0.0.1, once it has started (its lifespan done and
    the socket bound); stopped after. With a ``ServerConfig``, uvicorn runs with the serve command's own
    settings (``run.uvicorn_config``: header deadline, connection cap, WebSocket size, log redaction) on
    the config's port; without one, uvicorn's defaults on a free port."""
    import uvicorn

    from chattts_serve.server.run import uvicorn_config

    if config is None:
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    else:
        port = config.port
        server = uvicorn.Server(uvicorn_config(config, app))
    failure: list[BaseException] = []

    def run() -> None:
        try:
            server.run()  # off the main thread uvicorn installs no signal handlers
        except BaseException as exc:  # noqa: BLE001 - reported by alive()
            failure.append(exc)

    thread = threading.Thread(target=run, name=f"serve-{port}", daemon=True)
    thread.start()

    def alive() -> None:
        if failure or (not thread.is_alive() and not server.started):
            raise RuntimeError(f"in-process server stopped: {failure[:1]}")

    def stop() -> None:
        server.should_exit = True
        thread.join(30)
        assert not thread.is_alive(), "the in-process server did not stop within 30 s"

    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while not server.started:
            alive()
            assert time.monotonic() < deadline, "the in-process server did not start"
            time.sleep(0.05)
        yield InProcessServer(f"http://127.0.0.1:{port}", alive, stop)
    finally:
        stop()


def check_openai_error(resp: httpx.Response, status: int) -> dict:
    """The response has ``status`` and an OpenAI-shaped error body; returns the error object."""
    assert resp.status_code == status, f"{resp.status_code} != {status}: {resp.text[:500]}"
    assert resp.headers.get("content-type", "").startswith("application/json")
    body = resp.json()
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert isinstance(err.get("message"), str) and err["message"], err
    assert isinstance(err.get("type"), str) and err["type"], err
    assert "param" in err and "code" in err, err
    return err


def wait_until(predicate: Callable[[], bool], timeout: float = 5.0, interval: float = 0.05) -> bool:
    """Poll ``predicate`` until it holds (True) or ``timeout`` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)


def burst_behind_a_held_batch(engine, post: Callable[[int], None], release: Callable[[], None], timeout: float) -> None:
    """``post(0)`` until its batch is held in the model, then ``post(1..3)`` at once until all four are submitted
    behind the held step; ``release()`` the model and wait for every request. The next batch then holds the three
    together, as far as the engine's budget lets it (the caller asserts what ran)."""
    first = threading.Thread(target=post, args=(0,))
    first.start()
    assert wait_until(lambda: engine.stats().num_running == 1, 30)  # held in the model
    others = [threading.Thread(target=post, args=(i,)) for i in (1, 2, 3)]
    for t in others:
        t.start()
    assert wait_until(lambda: len(engine._collectors) == 4, 30)  # submitted, behind the held step
    release()
    for t in (first, *others):
        t.join(timeout)
