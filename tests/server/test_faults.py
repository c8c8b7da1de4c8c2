"""Fault injection: an in-process server (uvicorn in a thread on 127.0.0.1) whose engine is made to fail
at one place at a time (runner step, scheduler update, stream creation, audio decode, encoder write).
Only the affected requests fail, each ends as an error in its transport (500 JSON before the first
byte, an SSE error event, an aborted body), capacity is released, and the server keeps serving.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from chattts_serve.engine.async_engine import AsyncEngine
from chattts_serve.engine.config import EngineConfig
from chattts_serve.engine.engine import Engine
from chattts_serve.server.app import create_app
from chattts_serve.server.config import ServerConfig

from .conftest import HTTP_TIMEOUT, check_openai_error, expected_samples, free_port, metric, serving, wait_until

TEXT = "今天天气真不错。"
TOKENS = 24
BODY = {
    "text": TEXT,
    "format": "pcm",
    "seed": 1,
    "refine_text": False,
    "min_new_tokens": TOKENS,
    "max_new_tokens": TOKENS,
}


@contextmanager
def in_process_server(engine: AsyncEngine, tmp: Path, log_level: str = "warning", **settings) -> Iterator[str]:
    """``create_app`` around ``engine``, served in-process (``serving``); yields the base URL once ready.
    ``settings``: more ``ServerConfig`` options (flat names, as the flags). No result cache: every request here
    must reach the engine its faults are injected into (a cached answer would skip them)."""
    settings = {"cache_mb": 0, **settings}
    config = ServerConfig.from_flat(
        voices_db=str(tmp / "voices.sqlite3"), warmup=False, port=free_port(), log_level=log_level, **settings
    )
    with serving(create_app(config, engine), config) as srv:
        assert wait_until(lambda: _ready(srv.base), timeout=60)
        yield srv.base


@pytest.fixture(scope="module")
def served(tiny_ckpt, tmp_path_factory):
    engine = AsyncEngine(Engine.from_pretrained(tiny_ckpt, config=EngineConfig.with_slots(2)))
    with in_process_server(engine, tmp_path_factory.mktemp("faults")) as base:
        yield base, engine


def _ready(base: str) -> bool:
    try:
        return httpx.get(base + "/ready", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


@contextmanager
def fault(obj, name: str, after: int = 0, times: int = 1) -> Iterator[list[int]]:
    """Make ``obj.name`` raise on calls ``after`` .. ``after + times - 1`` (0-based), then behave."""
    original = getattr(obj, name)
    calls = [0]

    def failing(*a, **k):
        n = calls[0]
        calls[0] += 1
        if after <= n < after + times:
            raise RuntimeError(f"injected fault in {name}")
        return original(*a, **k)

    setattr(obj, name, failing)
    try:
        yield calls
    finally:
        setattr(obj, name, original)


def _healthy_after(base: str) -> None:
    """Capacity released and the server still serving correctly."""
    assert wait_until(lambda: metric(base, "chattts_kv_slots_used") == 0, timeout=30)
    assert wait_until(lambda: metric(base, "chattts_requests_in_flight") == 0, timeout=30)
    assert httpx.get(base + "/health", timeout=HTTP_TIMEOUT).status_code == 200
    r = httpx.post(base + "/v1/tts", json={**BODY, "stream": False}, timeout=HTTP_TIMEOUT)
    assert r.status_code == 200 and len(r.content) == 2 * expected_samples(TOKENS)


@pytest.mark.parametrize(
    "where",
    [
        ("runner", "execute", 3),  # the model step, mid-generation
        ("pipeline", "update", 3),  # after the tokens came back (an unguarded place: the engine resets)
        ("model_decoder", "forward", 0),  # audio decode
    ],
    ids=["runner-step", "pipeline-update", "audio-decode"],
)
def test_whole_file_request_fails_with_500_json(served, where):
    base, engine = served
    owner, name, after = where
    obj = {
        "runner": engine.core.stage.runner,
        "pipeline": engine.core.stage.pipeline,
        "model_decoder": engine.engine.model.decoder,
    }
    with fault(obj[owner], name, after=after):
        r = httpx.post(base + "/v1/tts", json={**BODY, "stream": False}, timeout=HTTP_TIMEOUT)
    err = check_openai_error(r, 500)
    assert err["code"] == "synthesis_failed" and "injected" not in err["message"]  # no internal text
    _healthy_after(base)


def test_sse_failure_is_an_error_event_not_done(served):
    base, engine = served
    body = {
        "model": "tts-1",
        "voice": "alloy",
        "input": TEXT,
        "response_format": "pcm",
        "stream_format": "sse",
        "seed": 1,
        "min_new_tokens": 200,
        "max_new_tokens": 200,
        "refine_text": False,
    }
    lines = []
    with fault(engine.core.stage.runner, "execute", after=40):  # after the first chunk (14 steps) left
        with httpx.stream("POST", base + "/v1/audio/speech", json=body, timeout=HTTP_TIMEOUT) as r:
            # The error event, and then the body is cut: a client that ignores error events still fails.
            with pytest.raises(httpx.RemoteProtocolError):
                for line in r.iter_lines():
                    lines.append(line)
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert events[-1]["type"] == "error" and events[-1]["error"]["code"] == "synthesis_failed"
    assert not any(e["type"] == "speech.audio.done" for e in events)
    _healthy_after(base)


def test_streamed_body_is_cut_not_completed(served):
    base, engine = served
    with fault(engine.core.stage.runner, "execute", after=30):
        with pytest.raises(httpx.RemoteProtocolError):  # no terminating chunk: the client sees a broken body
            with httpx.stream(
                "POST",
                base + "/v1/tts",
                json={**BODY, "min_new_tokens": 300, "max_new_tokens": 300},
                timeout=HTTP_TIMEOUT,
            ) as r:
                assert r.status_code == 200
                for _ in r.iter_raw():
                    pass
    _healthy_after(base)


def test_encoder_failure_ends_the_response(served, monkeypatch):
    from chattts_serve.audio.encode import StreamingEncoder

    base, _ = served
    with fault(StreamingEncoder, "write", after=0):
        with pytest.raises(httpx.RemoteProtocolError):
            with httpx.stream("POST", base + "/v1/tts", json={**BODY, "format": "mp3"}, timeout=HTTP_TIMEOUT) as r:
                for _ in r.iter_raw():
                    pass
    _healthy_after(base)


def test_other_requests_are_untouched(served):
    """A fault in one request's stream creation fails that request only; one running beside it ends
    normally with all its audio."""
    base, engine = served
    results: dict[str, httpx.Response] = {}

    def long_one():
        results["long"] = httpx.post(
            base + "/v1/tts",
            json={**BODY, "stream": False, "min_new_tokens": 120, "max_new_tokens": 120},
            timeout=HTTP_TIMEOUT,
        )

    t = threading.Thread(target=long_one)
    t.start()
    # The long request's audio stream exists before the fault is installed (it must not hit it).
    requests = engine.core.stage.pipeline.requests
    assert wait_until(lambda: any(r.segments[0].stream is not None for r in list(requests.values())), timeout=30)
    import chattts_serve.engine.pipeline as pipeline

    with fault(pipeline, "AudioStream", after=0):
        r = httpx.post(base + "/v1/tts", json={**BODY, "stream": False}, timeout=HTTP_TIMEOUT)
    t.join(HTTP_TIMEOUT)
    assert results["long"].status_code == 200 and len(results["long"].content) == 2 * expected_samples(120)
    check_openai_error(r, 500)
    _healthy_after(base)


def test_a_dead_engine_loop_fails_health(tiny_ckpt, tmp_path):
    """If even the reset after a failed step fails, the loop ends: /health says so (an orchestrator
    restarts the process) and requests get 503, not a hang."""
    engine = AsyncEngine(Engine.from_pretrained(tiny_ckpt, config=EngineConfig.with_slots(1)))
    with in_process_server(engine, tmp_path, log_level="critical") as base:
        with fault(engine.core.stage.pipeline, "update", times=10**6), fault(engine.core, "reset", times=10**6):
            r = httpx.post(base + "/v1/tts", json={**BODY, "stream": False}, timeout=HTTP_TIMEOUT)
        assert r.status_code in (500, 503)
        assert wait_until(lambda: httpx.get(base + "/health", timeout=10).status_code == 503, timeout=30)
        check_openai_error(httpx.post(base + "/v1/tts", json={**BODY, "stream": False}, timeout=HTTP_TIMEOUT), 503)
        assert httpx.get(base + "/ready", timeout=10).status_code == 503


def test_voice_store_failure_during_synthesis_is_a_json_error(served, monkeypatch):
    from chattts_serve.server.voices import VoiceStore, VoiceStoreError

    base, _ = served

    def busy(self, name, tenant=None):
        raise VoiceStoreError("busy", "the voices database is busy")

    monkeypatch.setattr(VoiceStore, "get", busy)
    r = httpx.post(
        base + "/v1/audio/speech", json={"model": "tts-1", "voice": "alloy", "input": TEXT}, timeout=HTTP_TIMEOUT
    )
    err = check_openai_error(r, 503)
    assert err["code"] == "storage_busy" and r.headers["retry-after"] == "1"
    monkeypatch.undo()
    _healthy_after(base)
