"""server/audio_response.py: the encoder that works in a worker thread, and when its codec may be freed."""

from __future__ import annotations

import asyncio
import threading

import numpy as np

from chattts_serve.audio.encode import StreamingEncoder
from chattts_serve.server.audio_response import ThreadedEncoder


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
        encoder = ThreadedEncoder("opus")
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
        encoder = ThreadedEncoder("mp3")
        try:
            return await encoder.write(np.zeros(24000, np.float32)) + await encoder.finish()
        finally:
            encoder.close()

    assert len(asyncio.run(main())) > 0
