"""A streaming-text session, transport-neutral: text that arrives in pieces (as a language model writes it) is
spoken a part at a time, the audio going out as it is made.

The WebSocket ``/v1/tts/stream`` (``server.websocket``) and the Wyoming server (``server.wyoming``) are thin
framings of it: a framing reads its protocol's messages (through ``TextSession.receive``, which runs the idle
clock), feeds their text to a ``TextStream`` and gives each stream a ``Sink`` that puts audio and notices on its
wire. What both protocols promise lives here, once:

* a reader task (the framing's loop) and a speaker task that speaks the queued parts in order; either may end
  the session, the other is then cancelled (cancelling the speaker aborts its engine request);
* backpressure: at most ``ws_max_pending_sentences`` parts wait; a full queue stops the reader, and the client's
  messages wait in the socket buffers;
* the idle clock: ``ws_idle_timeout_s`` without a message while nothing is being spoken or waiting;
* the text limit: ``ws_max_text_chars`` per stream; parts of at most ``max_input_chars`` (``text_parts``);
* the audio limit: ``ws_max_audio_seconds`` per stream, counted as the client gets it (``server.budget``'s way:
  a slow-down stretch at its stretched length); each part's engine budget is what the stream has left, so a
  part whose minimum would pass it is refused before it is spoken and a longer one is cut at the limit;
* a part the engine refuses (bad input) is reported to the sink and skipped; any other failure ends the session;
* the first part's voice: every later part of a stream is spoken with it.

Errors carry a kind (``ErrorKind``) and a short code that both protocols' error events show; each framing maps
the kind onto its own wire (the WebSocket onto close codes). HTTP status codes stay out of the framings:
``error_from_api`` reads the service's HTTP-shaped ``APIError`` once, here.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import Protocol, TypeVar

import numpy as np

from .. import models
from ..audio.policy import StreamPolicy
from ..engine.async_engine import EngineDeadError, EngineError
from ..engine.outputs import RequestOutput
from ..models.chattts.config import TOKENS_PER_SECOND
from ..models.chattts.speaker import MIN_VOICE_SAMPLES
from ..sampling_params import SamplingParams
from ..text.ssml import is_ssml
from .audio_response import AudioResponse
from .errors import APIError
from .text_parts import Segmenter, speakable

logger = logging.getLogger(__name__)
T = TypeVar("T")

ECHO_CHARS = 100
"""An error quotes at most this much of the client's message at fault."""
MAX_ERROR_CHARS = 300


class ErrorKind(enum.Enum):
    """What went wrong, in words every protocol can map onto its own codes."""

    BAD_INPUT = "bad_input"
    """The client sent something invalid: a malformed message, bad options, text the engine refuses."""
    UNSUPPORTED = "unsupported"
    """Data of a type the protocol does not carry here (a WebSocket binary frame)."""
    TOO_LARGE = "too_large"
    """One message over the size limit."""
    OVER_LIMIT = "over_limit"
    """The stream's text over ``ws_max_text_chars``, or its audio at ``ws_max_audio_seconds``."""
    IDLE = "idle"
    """Nothing received for ``ws_idle_timeout_s`` while nothing was being spoken."""
    OVERLOADED = "overloaded"
    """No capacity now; the client may retry later."""
    SHUTDOWN = "shutdown"
    """The server is stopping; the client may reconnect elsewhere."""
    INTERNAL = "internal"
    """Synthesis failed once started, or a bug: never the client's fault."""


class SessionError(Exception):
    """Ends the session (or, for a refused part, only that part): its ``kind``, a short ``message`` for the
    client and a ``code`` (``text_limit``, ``capacity``, ...) that the framings send as they are."""

    def __init__(self, kind: ErrorKind, message: str, code: str) -> None:
        super().__init__(message)
        self.kind, self.message, self.code = kind, excerpt(message, MAX_ERROR_CHARS), code


class Gone(Exception):
    """The client has gone (or stopped reading): nothing more can be sent."""


def error_from_api(exc: APIError) -> SessionError:
    """The service's error as a session error: the one place its HTTP status is read."""
    if exc.code == "capacity":
        kind = ErrorKind.OVERLOADED
    elif exc.code == "server_shutdown":
        kind = ErrorKind.SHUTDOWN
    elif exc.status_code < 500:
        kind = ErrorKind.BAD_INPUT
    else:
        kind = ErrorKind.INTERNAL
    default = "invalid_request" if kind is ErrorKind.BAD_INPUT else "server_error"
    return SessionError(kind, str(exc.detail), exc.code or default)


def excerpt(text: str | bytes, limit: int = ECHO_CHARS) -> str:
    """At most ``limit`` characters of ``text`` (an error must not echo a whole message back)."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


class Sink(Protocol):
    """Where a stream's audio and notices go: its framing's wire."""

    async def audio(self, part: int, chunk: RequestOutput) -> None:
        """A delta of part ``part``'s audio, as the engine made it (its audio may be empty)."""

    def part_done(self) -> None:
        """The current part's audio is over: complete, failed or cancelled."""

    async def refused(self, part: int, text: str, error: SessionError) -> None:
        """The engine refused part ``part`` (``error.kind`` is BAD_INPUT): returning skips it, raising ends the
        session."""

    async def end(self) -> None:
        """Every part of the stream has been spoken (or skipped)."""


@dataclass(slots=True)
class _Job:
    """One item for the speaker, in order: a part to speak (``text``), then perhaps the end of its stream and
    of the session."""

    stream: TextStream
    text: str | None
    end: bool = False
    last: bool = False


class TextStream:
    """One stream of text on a session: cut into parts (``Segmenter``), checked against the text limit and
    queued for the speaker; ``params`` become the first part's voice once it has been spoken."""

    def __init__(
        self,
        session: TextSession,
        params: SamplingParams,
        policy: StreamPolicy,
        sink: Sink,
        keep_first_voice: bool,
        stretch: float = 1.0,
    ) -> None:
        self.session, self.params, self.policy, self.sink = session, params, policy, sink
        self.keep_first_voice = keep_first_voice
        self.stretch = stretch
        """The sink's time stretch: a slowed-down part's audio counts at its stretched length (``server.budget``)."""
        self.segmenter = Segmenter(session.cfg.max_input_chars)
        self.text_chars = 0
        self.audio_s = 0.0
        """The stream's audio so far, counted at its longest: stretched when slowed down, the model's when sped
        up (``server.budget``); ``ws_max_audio_seconds`` bounds it."""
        self.num_parts = 0
        """Parts started so far: the next part's index (a refused part does not count)."""

    async def feed(self, text: str) -> None:
        """Takes more text: queues each part it completes (waits while the queue is full: backpressure)."""
        limit = self.session.cfg.ws.max_text_chars
        self.text_chars += len(text)
        if self.text_chars > limit:
            raise SessionError(ErrorKind.OVER_LIMIT, f"the streamed text exceeds {limit} characters", "text_limit")
        for part in self.segmenter.feed(text):
            await self._queue(part)

    async def end(self, last: bool = False) -> None:
        """No more text: the rest is spoken, then the sink's ``end``; ``last``: then the session ends."""
        for part in self.segmenter.flush():
            await self._queue(part)
        await self.session.jobs.put(_Job(self, None, end=True, last=last))

    async def say(self, text: str) -> None:
        """The whole text as one part, then the end (a single request: neither cut nor counted)."""
        await self.session.jobs.put(_Job(self, text if speakable(text) else None, end=True))

    async def _queue(self, part: str) -> None:
        if is_ssml(part):  # parts are cut at sentence ends, which would cut SSML's elements apart (text/ssml.py)
            message = "SSML is not accepted in streamed text: send it whole to POST /v1/tts or /v1/audio/speech"
            raise SessionError(ErrorKind.BAD_INPUT, message, "ssml_streamed")
        if speakable(part):
            await self.session.jobs.put(_Job(self, part))


class TextSession:
    """One client's session: its queue of parts, the speaker that speaks them and the idle clock. ``state`` is
    the app's (engine, limits, metrics, config); ``endpoint`` names the requests in the metrics."""

    def __init__(self, state, endpoint: str, request_prefix: str = "") -> None:
        self.st, self.cfg = state, state.config
        self.endpoint, self.request_prefix = endpoint, request_prefix
        self.id = uuid.uuid4().hex[:12]
        # Bounded: a full queue stops the reader, which is the backpressure on a client that outruns synthesis.
        self.jobs: asyncio.Queue[_Job] = asyncio.Queue(maxsize=self.cfg.ws.max_pending_sentences)
        self.speaking = False
        self.last_activity = time.monotonic()
        self.num_requests = 0
        self._next: asyncio.Future | None = None

    def stream(
        self,
        params: SamplingParams,
        policy: StreamPolicy,
        sink: Sink,
        keep_first_voice: bool = True,
        stretch: float = 1.0,
    ) -> TextStream:
        return TextStream(self, params, policy, sink, keep_first_voice, stretch)

    # ------------------------------------------------------------------ the two tasks

    async def run(self, read: Callable[[], Awaitable[None]]) -> SessionError | None:
        """Runs the framing's reader ``read`` and the speaker until the speaker has ended the session's last
        stream, or either task fails. Returns the error to tell the client; None when the session ended well or
        the client has gone."""
        reading = asyncio.create_task(read())
        speaking = asyncio.create_task(self._speak())
        try:
            await _until_done(reading, speaking)
        except Gone:
            return None
        except SessionError as exc:
            return exc
        except Exception:  # a bug must still end the session as a failure, never hang or look like success
            logger.exception("%s session %s failed", self.endpoint, self.id)
            return SessionError(ErrorKind.INTERNAL, "internal server error", "server_error")
        finally:
            for task in (reading, speaking):
                task.cancel()
            await asyncio.gather(reading, speaking, return_exceptions=True)
            if self._next is not None:
                self._next.cancel()
        return None

    async def receive(self, read: Callable[[], Awaitable[T]]) -> T:
        """The next message (``read()``); ``SessionError`` once the client has been idle for ``ws_idle_timeout_s``.
        A read in progress is kept across the idle checks, never cancelled (that could lose half a message)."""
        if self._next is None:
            self._next = asyncio.ensure_future(read())
        while True:
            wait = self._idle_left()
            if wait <= 0:
                idle = self.cfg.ws.idle_timeout_s
                message = f"nothing received for {idle:g} s while nothing was being spoken"
                raise SessionError(ErrorKind.IDLE, message, "idle_timeout")
            done, _ = await asyncio.wait({self._next}, timeout=wait)
            if done:  # else: check again, speech may have started or ended meanwhile
                reading, self._next = self._next, None
                self.last_activity = time.monotonic()
                return reading.result()

    def _idle_left(self) -> float:
        timeout = self.cfg.ws.idle_timeout_s
        if self.speaking or not self.jobs.empty():
            return timeout  # the clock does not run while audio is being made
        return self.last_activity + timeout - time.monotonic()

    # ------------------------------------------------------------------ speaking

    async def _speak(self) -> None:
        while True:
            job = await self.jobs.get()
            self.speaking = True
            try:
                if job.text is not None:
                    await self._speak_part(job.stream, job.text)
                if job.end:
                    await job.stream.sink.end()
            finally:
                self.speaking = False
                self.last_activity = time.monotonic()  # the idle clock starts when the audio is out
            if job.last:
                return

    async def _speak_part(self, stream: TextStream, text: str) -> None:
        """One engine request, its audio to the sink as it comes. The first part's audio becomes every later
        part's voice (the engine's first-sentence voice step, for text that arrives in pieces)."""
        st = self.st
        resp = AudioResponse(st.engine, st.metrics, st.limits, self.endpoint, self.cfg.timeouts.queue_wait_s)
        request_id = f"{self.request_prefix}{self.id}-{self.num_requests}"
        self.num_requests += 1
        # each part as one request: its stretched audio within max_audio_seconds and what the stream has left
        # of ws_max_audio_seconds (server.budget)
        limit, longest = self.cfg.ws.max_audio_seconds, min(1.0, stream.stretch)
        room, engine_limit = limit - stream.audio_s, st.engine.max_audio_seconds
        if room * TOKENS_PER_SECOND < 1:  # not one step left
            raise _audio_limit(limit, stream.audio_s)
        budget = min(engine_limit, room) * longest
        try:
            bound = budget if budget < engine_limit else None
            await resp.start(text, stream.params, stream.policy, request_id, max_audio_seconds=bound)
        except APIError as exc:
            if exc.code == "audio_limit" and room < engine_limit:  # the stream's limit, not the request's
                raise _audio_limit(limit, stream.audio_s, str(exc.detail)) from None
            error = error_from_api(exc)
            if error.kind is not ErrorKind.BAD_INPUT:
                raise error from None
            await stream.sink.refused(stream.num_parts, text, error)  # this part only: the stream goes on
            return
        part, stream.num_parts = stream.num_parts, stream.num_parts + 1
        keep = stream.keep_first_voice and _voice_from_first_part(stream.params, st.engine.family.name)
        first_part_audio = [] if keep else None
        try:
            async with aclosing(resp.chunks()) as chunks:  # closing it (cancelled, failed) aborts the request
                async for chunk in chunks:
                    await stream.sink.audio(part, chunk)
                    if first_part_audio is not None:
                        first_part_audio.append(chunk.audio)
                        if chunk.finished and chunk.finish_reason in ("stop", "length"):
                            stream.params = await _first_part_voice(st.engine, stream.params, chunk, first_part_audio)
        except (APIError, EngineError, EngineDeadError) as exc:  # StreamFailed: it failed after it started
            raise _failure(exc) from None
        finally:
            stream.audio_s += resp.samples / st.engine.sample_rate / longest
            stream.sink.part_done()


async def _until_done(reading: asyncio.Task, speaking: asyncio.Task) -> None:
    """Returns when the speaker has finished; raises what ended either task first (a reader that returns has
    queued everything: the speaker goes on)."""
    pending = {reading, speaking}
    while speaking in pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            if task.exception() is not None:
                raise task.exception()


def _audio_limit(limit: float, spoken: float, why: str = "") -> SessionError:
    """The stream has spoken ``spoken`` of its ``limit`` seconds, and its next part does not fit (``why``)."""
    message = f"the stream's audio would pass its limit of {limit:g} s (ws_max_audio_seconds; {spoken:.1f} s spoken)"
    return SessionError(ErrorKind.OVER_LIMIT, f"{message}: {why}" if why else message, "audio_limit")


def _failure(exc: Exception) -> SessionError:
    """A synthesis that failed midway ends the session (it must not look like success)."""
    if isinstance(exc, APIError):
        return error_from_api(exc)
    logger.error("synthesis failed: %s", exc)
    return SessionError(ErrorKind.INTERNAL, "synthesis failed; the server log has the cause", "synthesis_failed")


def _voice_from_first_part(params: SamplingParams, family: str) -> bool:
    """Split text with the first-sentence voice step and no voice sample given: the first part sets the voice.
    Only for a family that has the voice step (ChatTTS: it owns ``first_sentence_voice``); another family's voice
    is its voice string, the same in every part."""
    if models.option_owners().get("first_sentence_voice") != family:
        return False
    return params.split_text and params.first_sentence_voice and params.speaker_sample is None


async def _first_part_voice(engine, params: SamplingParams, final: RequestOutput, audio: list[np.ndarray]):
    """The stream's voice, kept from its first part on: every later part is spoken with a voice sample of the
    first part's audio and its text as transcript (the engine's voice step, for text that arrives in pieces;
    the first part itself has already been heard as it was)."""
    if not final.segments:
        return params
    sample = final.voice_sample
    if sample is None:
        wav = np.concatenate(audio) if audio else np.zeros(0, np.float32)
        if len(wav) < MIN_VOICE_SAMPLES:
            return params
        sample = await engine.speaker_from_audio(wav)
    return replace(params, speaker_sample=sample, speaker_sample_text=final.segments[0].text)
