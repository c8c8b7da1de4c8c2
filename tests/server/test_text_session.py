"""server/text_session.py without a transport: a fake engine and a sink that records what a framing would send.
The WebSocket and Wyoming framings are tested over their wires (test_websocket.py, test_wyoming.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from chattts_serve import models
from chattts_serve.audio.policy import StreamPolicy
from chattts_serve.engine.async_engine import EngineError
from chattts_serve.engine.outputs import RequestOutput, SegmentResult
from chattts_serve.sampling_params import SamplingParams
from chattts_serve.server.config import ServerConfig
from chattts_serve.server.errors import APIError, StreamEndedByShutdown, busy
from chattts_serve.server.limits import Limits
from chattts_serve.server.metrics import Metrics
from chattts_serve.server.text_session import ErrorKind, Gone, SessionError, TextSession, error_from_api

REFUSED = "refuse me."
FAILS = "fail midway."


class FakeEngine:
    """Two deltas per request (8 samples each); ``REFUSED`` is refused like text the engine cannot speak, ``FAILS``
    fails after its first delta. The last delta carries a voice sample, as the engine's voice step makes one."""

    sample_rate = 24000
    max_audio_seconds = 600.0
    family = models.get("chattts")  # the family with the voice step (its voice samples)

    def __init__(self) -> None:
        self.requests: list[tuple[str, SamplingParams]] = []

    async def stream(self, text, params, request_id, policy):
        self.requests.append((text, params))
        if text.strip() == REFUSED:
            raise ValueError("text has nothing to speak")
        yield RequestOutput(request_id, np.ones(8, np.float32))
        if text.strip() == FAILS:
            raise EngineError("injected")
        segment = SegmentResult(text, np.zeros((1, 4), np.int64), "stop")
        final = np.ones(8, np.float32)
        yield RequestOutput(request_id, final, True, "stop", segments=[segment], voice_sample=f"voice of {text}")


class RecordingSink:
    def __init__(self) -> None:
        self.events: list[tuple] = []

    async def audio(self, part, chunk):
        self.events.append(("audio", part, len(chunk.audio)))

    def part_done(self):
        self.events.append(("done",))

    async def refused(self, part, text, error):
        self.events.append(("refused", part, text, error.kind, error.code))

    async def end(self):
        self.events.append(("end",))


def _session(max_in_flight: int = 4, **config) -> TextSession:
    cfg = {
        "max_input_chars": 50,
        "ws_max_text_chars": 1000,
        "ws_max_pending_sentences": 2,
        "ws_idle_timeout_s": 5.0,
        "max_queue_wait_s": 5.0,
    }
    cfg.update(config)
    state = SimpleNamespace(
        config=ServerConfig.from_flat(**cfg), engine=FakeEngine(), metrics=Metrics(), limits=Limits(max_in_flight)
    )
    return TextSession(state, "test")


def _run(session: TextSession, pieces: list[str], sink: RecordingSink) -> SessionError | None:
    """A reader that feeds ``pieces`` to one stream, then ends it and the session."""

    async def read() -> None:
        stream = session.stream(SamplingParams(), StreamPolicy(), sink)
        for piece in pieces:
            await stream.feed(piece)
        await stream.end(last=True)

    return asyncio.run(session.run(read))


def test_parts_are_spoken_in_order_then_the_end():
    session, sink = _session(), RecordingSink()
    assert _run(session, ["Hello there. How", " are you? Fine"], sink) is None
    texts = [text for text, _ in session.st.engine.requests]
    assert texts == ["Hello there.", " How are you?", " Fine"]
    assert sink.events == [e for part in range(3) for e in (("audio", part, 8),) * 2 + (("done",),)] + [("end",)]


def test_every_later_part_has_the_first_parts_voice():
    session = _session()
    assert _run(session, ["One.", " Two.", " Three."], RecordingSink()) is None
    samples = [params.speaker_sample for _, params in session.st.engine.requests]
    assert samples == [None, "voice of One.", "voice of One."]


def test_a_refused_part_is_skipped_and_the_stream_goes_on():
    session, sink = _session(), RecordingSink()
    assert _run(session, ["Hi. ", REFUSED, " Bye."], sink) is None
    refused = [e for e in sink.events if e[0] == "refused"]
    # the refused part does not count: the next part has its index
    assert refused == [("refused", 1, " " + REFUSED, ErrorKind.BAD_INPUT, "invalid_request")]
    assert {e[1] for e in sink.events if e[0] == "audio"} == {0, 1} and sink.events[-1] == ("end",)


def test_a_sink_that_raises_on_a_refused_part_ends_the_session():
    class Strict(RecordingSink):
        async def refused(self, part, text, error):
            raise error

    error = _run(_session(), [REFUSED], Strict())
    assert error is not None and error.kind is ErrorKind.BAD_INPUT


def test_no_capacity_ends_the_session_as_overloaded():
    error = _run(_session(max_in_flight=0), ["Hello."], RecordingSink())
    assert error is not None and (error.kind, error.code) == (ErrorKind.OVERLOADED, "capacity")


def test_a_failure_midway_is_internal_and_never_the_end():
    sink = RecordingSink()
    error = _run(_session(), [FAILS], sink)
    assert error is not None and (error.kind, error.code) == (ErrorKind.INTERNAL, "synthesis_failed")
    assert "injected" not in error.message  # the cause goes to the log
    assert sink.events == [("audio", 0, 8), ("done",)]


def test_the_text_limit_counts_the_whole_stream():
    sink = RecordingSink()
    error = _run(_session(ws_max_text_chars=10), ["abcdef", "ghijkl"], sink)
    assert error is not None and (error.kind, error.code) == (ErrorKind.OVER_LIMIT, "text_limit")
    assert ("end",) not in sink.events


def test_a_client_that_sends_nothing_is_idle():
    session = _session(ws_idle_timeout_s=0.05)

    async def read() -> None:
        await session.receive(asyncio.Event().wait)  # nothing ever comes

    error = asyncio.run(session.run(read))
    assert error is not None and (error.kind, error.code) == (ErrorKind.IDLE, "idle_timeout")


def test_a_full_queue_stops_the_reader():
    """ws_max_pending_sentences (2) parts wait while the speaker is held: the reader blocks on the third."""
    session, sink, fed = _session(), RecordingSink(), []
    hold = None

    async def held_audio(part, chunk):
        await hold.wait()
        sink.events.append(("audio", part, len(chunk.audio)))

    sink.audio = held_audio

    async def read() -> None:
        stream = session.stream(SamplingParams(), StreamPolicy(), sink)
        for i in range(6):
            await stream.feed(f"Part {i}. ")  # the space decides the full stop
            fed.append(i)
        await stream.end(last=True)

    async def main():
        nonlocal hold
        hold = asyncio.Event()
        running = asyncio.create_task(session.run(read))
        for _ in range(50):
            await asyncio.sleep(0.01)
        # one part being spoken, two waiting, the reader blocked while queueing the fourth
        assert fed == [0, 1, 2] and session.jobs.full()
        hold.set()
        return await running

    assert asyncio.run(main()) is None
    assert fed == list(range(6)) and sink.events[-1] == ("end",)


def test_a_client_that_has_gone_ends_quietly():
    session = _session()

    async def read() -> None:
        raise Gone

    assert asyncio.run(session.run(read)) is None


def test_a_bug_is_an_internal_error():
    session = _session()

    async def read() -> None:
        raise KeyError("a bug")

    error = asyncio.run(session.run(read))
    assert error is not None and (error.kind, error.code) == (ErrorKind.INTERNAL, "server_error")


@pytest.mark.parametrize(
    "exc,kind,code",
    [
        (APIError(400, "bad"), ErrorKind.BAD_INPUT, "invalid_request"),
        (APIError(400, "long", code="input_too_long"), ErrorKind.BAD_INPUT, "input_too_long"),
        (busy("full"), ErrorKind.OVERLOADED, "capacity"),
        (busy("later", status=503), ErrorKind.OVERLOADED, "capacity"),
        (StreamEndedByShutdown("r1"), ErrorKind.SHUTDOWN, "server_shutdown"),
        (APIError(503, "stopped", code="engine_unavailable"), ErrorKind.INTERNAL, "engine_unavailable"),
    ],
)
def test_service_errors_become_kinds(exc, kind, code):
    error = error_from_api(exc)
    assert (error.kind, error.code, error.message) == (kind, code, exc.detail)


def test_error_messages_are_short():
    assert len(SessionError(ErrorKind.BAD_INPUT, "x" * 5000, "invalid_request").message) < 350
