"""``_AudioOut`` (server/wyoming.py) on its own: a long delta goes out as many audio-chunk events without holding
the event loop for the whole delta."""

from __future__ import annotations

import asyncio

import numpy as np

from chattts_serve.engine.outputs import RequestOutput
from chattts_serve.server.wyoming import SAMPLES_PER_CHUNK, YIELD_EVERY_EVENTS, _AudioOut


class _Connection:
    """A client whose socket always has room: ``send`` never suspends (a local client that reads fast)."""

    def __init__(self) -> None:
        self.events = []

    async def send(self, event) -> None:
        self.events.append(event)


def test_a_long_delta_lets_the_loop_run_between_its_events():
    events_per_delta = 40 * YIELD_EVERY_EVENTS
    audio = np.zeros(events_per_delta * SAMPLES_PER_CHUNK, np.float32)

    async def run() -> tuple[int, int]:
        ticks = 0
        stop = asyncio.Event()

        async def ticker() -> None:  # another connection's work: it must get turns while the delta goes out
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        conn = _Connection()
        start = ticks
        await _AudioOut(conn, streaming=False, rate=24000).audio(0, RequestOutput("r", audio))
        during = ticks - start
        stop.set()
        await task
        return during, len(conn.events)

    during, sent = asyncio.run(run())
    assert sent == events_per_delta + 1  # audio-start, then one event per chunk
    # before the fix the whole delta went out in one turn of the loop (during == 0)
    assert during >= events_per_delta // YIELD_EVERY_EVENTS - 1
