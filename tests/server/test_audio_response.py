"""server/audio_response.py: the encoder that works in a worker thread (and when its codec may be freed), and a
request that finishes without any audio."""

from __future__ import annotations

import asyncio
import io
import threading

import av
import numpy as np
import pytest

from chattts_serve.audio.encode import StreamingEncoder
from chattts_serve.engine.scheduler import Scheduler
from chattts_serve.server.audio_response import EMPTY_AUDIO_HEADER, ThreadedEncoder

from .conftest import app_config


def test_the_codec_is_freed_only_once_its_worker_thread_is_done(monkeypatch):
    """The client leaves while a frame is being encoded: the awaiter is cancelled but the thread runs on, so
    freeing the codec at once would free it under the thread (a crash in native code)."""
    entered, release, events = threading.Event(), threading.Event(), []
    real_write, real_close = StreamingEncoder.write, StreamingEncoder.close

    def slow_write(self, pcm):
        entered.set()
        release.wait(10)
        events.append("write done")
        return real_write(self, pcm)

    def close(self):
        events.append("close")
        real_close(self)

    monkeypatch.setattr(StreamingEncoder, "write", slow_write)
    monkeypatch.setattr(StreamingEncoder, "close", close)

    async def main() -> None:
        encoder = ThreadedEncoder("opus", model_rate=24000)
        writing = asyncio.ensure_future(encoder.write(np.zeros(4800, np.float32)))
        await asyncio.to_thread(entered.wait, 10)
        writing.cancel()
        await asyncio.gather(writing, return_exceptions=True)
        encoder.close()
        assert events == []  # not freed while the thread still encodes
        release.set()
        for _ in range(100):
            await asyncio.sleep(0.02)
            if "close" in events:
                break

    asyncio.run(main())
    assert events == ["write done", "close"]


def test_a_finished_encoder_has_made_a_whole_file():
    async def main() -> bytes:
        encoder = ThreadedEncoder("mp3", model_rate=24000)
        try:
            return await encoder.write(np.zeros(24000, np.float32)) + await encoder.finish()
        finally:
            encoder.close()

    assert len(asyncio.run(main())) > 0


# ----------------------------------------------------------------------------------- a request with no audio


@pytest.fixture(scope="module")
def client(tiny_ckpt, tmp_path_factory):
    """The app in process (no port) on its own engine."""
    from starlette.testclient import TestClient

    from chattts_serve.engine.async_engine import AsyncEngine
    from chattts_serve.engine.config import EngineConfig
    from chattts_serve.server.app import create_app

    config = app_config(tiny_ckpt, tmp_path_factory.mktemp("empty"))
    engine = AsyncEngine.from_pretrained(tiny_ckpt, "cpu", EngineConfig.with_slots(2))
    with TestClient(create_app(config, engine=engine)) as c:
        yield c


@pytest.fixture
def ends_at_step_0(monkeypatch):
    """Every code pass samples EOS at its first step, as a seeded request may on a real checkpoint (the
    tiny random one never does within thousands of seeds): the engine-level stub of an empty result."""
    real = Scheduler.update

    def update(self, sched, result):
        for seq in (*sched.prefill, *sched.decode):
            token = result.tokens.get(seq.seq_id)
            if token is not None and len(token) > 1 and not seq.tokens:  # a code sequence's first step
                result.tokens[seq.seq_id] = (seq.eos_id,) * len(token)
        return real(self, sched, result)

    monkeypatch.setattr(Scheduler, "update", update)


def _empty_count(client, endpoint: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(f'chattts_empty_audio_responses_total{{endpoint="{endpoint}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


_OPTIONS = {"seed": 260, "refine_text": False, "max_new_tokens": 21}


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("fmt", ["opus", "mp3", "aac", "flac", "wav", "pcm"])
def test_empty_audio_is_a_valid_file_and_says_so(client, ends_at_step_0, fmt, stream):
    """The issue's request ("今天天气很好。", seed 260, max_new_tokens 21) ended at step 0 and got 200 with 0
    bytes for opus and mp3: now a file the format's decoder opens, an X-Audio-Empty header and a count."""
    before = _empty_count(client, "tts")
    body = {"text": "今天天气很好。", "format": fmt, "stream": stream, **_OPTIONS}
    r = client.post("/v1/tts", json=body)
    assert r.status_code == 200 and r.headers[EMPTY_AUDIO_HEADER] == "1"
    if fmt == "pcm":
        assert r.content == b""
    else:
        assert len(_decoded(r.content)) <= 2048  # at most one codec frame of silence
    assert _empty_count(client, "tts") == before + 1


def test_openai_speech_says_its_audio_is_empty(client, ends_at_step_0):
    body = {"model": "tts-1", "voice": "alloy", "input": "今天天气很好。", "response_format": "mp3", **_OPTIONS}
    r = client.post("/v1/audio/speech", json=body)
    assert r.status_code == 200 and r.headers[EMPTY_AUDIO_HEADER] == "1" and len(_decoded(r.content))


def test_an_empty_websocket_stream_is_a_valid_file(client, ends_at_step_0):
    """The WebSocket's frames, put together, are one file too: with no audio, the shortest silence."""
    data = b""
    with client.websocket_connect("/v1/tts/stream") as ws:
        ws.send_json({"type": "start", "format": "opus", "text": "今天天气很好。", **_OPTIONS})
        ws.send_json({"type": "end"})
        while (event := ws.receive_json())["type"] != "end":
            assert event["type"] in ("start", "chunk"), event
            if event["type"] == "chunk" and event["bytes"]:
                data += ws.receive_bytes()
    assert event["audio_seconds"] == 0 and len(_decoded(data)) <= 2048


def test_audio_that_is_not_empty_has_no_empty_header(client):
    before = _empty_count(client, "tts")
    body = {"text": "今天天气很好。", "format": "mp3", "seed": 1, "refine_text": False, "max_new_tokens": 8}
    r = client.post("/v1/tts", json={**body, "min_new_tokens": 8})
    assert r.status_code == 200 and EMPTY_AUDIO_HEADER not in r.headers
    assert _empty_count(client, "tts") == before


def _decoded(data: bytes) -> np.ndarray:
    with av.open(io.BytesIO(data)) as container:
        frames = [f.to_ndarray().reshape(-1) for f in container.decode(audio=0)]
    return np.concatenate(frames) if frames else np.zeros(0)
