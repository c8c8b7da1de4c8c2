"""The Wyoming protocol (Home Assistant's voice pipeline): ``chattts-serve wyoming --uri tcp://HOST:PORT``, or
``chattts-serve serve --wyoming-uri ...`` next to the HTTP API on the same engine.

Events are the ``wyoming`` package's own types and its server loop accepts the connections:

* ``describe`` -> ``info``: one TTS program (``chattts``) with the saved voices and OpenAI's voice names, languages
  zh and en, ``supports_synthesize_streaming``.
* ``synthesize {text, voice: {name}}`` -> ``audio-start`` (24000 Hz, 16-bit, mono), ``audio-chunk``s as the engine
  makes them, ``audio-stop``.
* ``synthesize-start {voice}``, ``synthesize-chunk {text}``..., ``synthesize-stop``: text arrives as a language
  model writes it; each sentence is spoken as soon as it is complete, in one ``audio-start`` ... ``audio-stop``
  for the whole stream, then ``synthesize-stopped``. The ``synthesize`` a streaming client also sends (Home
  Assistant repeats the whole text in one for older servers) is ignored while a stream is open.
* ``ping`` -> ``pong``. Other events are ignored (the protocol's rule for events a program does not handle).

ChatTTS options: the server's ``default_options``, and, as an extension Home Assistant never sends, a
``chattts`` object in ``synthesize`` / ``synthesize-start`` data with the fields of a ``/v1/tts`` body (``seed``,
``refine_text``, ...). A voice's ``language`` (zh, en) sets ``lang``.

Errors: the server sends one ``error`` event ``{text, code}`` and closes the connection (Home Assistant waits for
audio until the connection closes: an error that left it open would hang it). The one exception is a sentence
of a stream the engine refuses: an ``error`` event, and the stream goes on without it. A client that
disconnects (or half-closes, as the library's own server loop treats it) aborts its requests at once.

Limits are ``serve``'s: ``max_input_chars`` per ``synthesize`` (a stream's text is cut into parts of at most
that), ``max_concurrent_streams``, ``max_queue_wait_s``, ``max_audio_seconds`` and ``send_timeout_s`` per
request; ``max_connections`` Wyoming connections; and the WebSocket's session limits: ``ws_max_message_bytes``
per event, ``ws_max_text_chars`` per stream, ``ws_max_pending_sentences`` queued (then the server stops
reading: backpressure), ``ws_idle_timeout_s`` without events while nothing is being spoken. The protocol has
no authentication: ``api_keys`` do not apply, so listen on a trusted network only.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass
from urllib.parse import SplitResult, urlsplit

import numpy as np
from pydantic import ValidationError
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.error import Error
from wyoming.event import Event, async_write_event
from wyoming.info import Attribution, Describe, Info, TtsProgram, TtsVoice
from wyoming.ping import Ping, Pong
from wyoming.server import AsyncEventHandler, AsyncServer
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeStopped

from .. import __version__
from ..audio.encode import to_pcm16
from ..engine.async_engine import EngineDeadError, EngineError
from ..model.config import SAMPLE_RATE
from ..sampling_params import SamplingParams
from .audio_response import AudioResponse
from .errors import APIError, check_length
from .params import build_params, request_defaults, resolve_voice
from .protocol import ChatTTSOptions
from .text_parts import Segmenter, speakable, voice_from_first_part, with_first_part_voice
from .voices import BUILTIN_VOICES, VoiceStoreError

logger = logging.getLogger(__name__)

PROGRAM = "chattts"
LANGUAGES = ["zh", "en"]
SAMPLE_WIDTH = 2  # bytes: 16-bit PCM
CHANNELS = 1
SAMPLES_PER_CHUNK = 1024
"""Audio is sent in events of at most this many samples (43 ms), as the Wyoming TTS servers do: a player
starts on the first small one instead of waiting for a whole engine chunk (up to seconds)."""
_CHATTTS = Attribution(name="2noise", url="https://github.com/2noise/ChatTTS")
_SERVER = Attribution(name="chattts-serve", url="https://github.com/2noise/ChatTTS")
_MAX_ERROR_CHARS = 300


class _Fail(Exception):
    """Ends the connection: an ``error`` event with ``code``, then the close."""

    def __init__(self, text: str, code: str) -> None:
        super().__init__(text)
        self.text, self.code = text, code


class _Gone(Exception):
    """The client has gone (or stopped reading): nothing more can be sent."""


def _fail_from(exc: APIError) -> _Fail:
    return _Fail(str(exc.detail), exc.code or "invalid_request")


# ---------------------------------------------------------------------------------------------------- reading


async def read_event(reader: asyncio.StreamReader, max_bytes: int) -> Event | None:
    """The next event (the protocol's framing: a JSON header line, then ``data_length`` bytes of JSON data and
    ``payload_length`` bytes of payload); None at the end of the stream. The library's own reader turns a
    malformed event into the end of the stream and reads any length a header announces; this one says what is
    wrong (``_Fail``) and refuses an event larger than ``max_bytes`` before reading it."""
    try:
        line = await reader.readline()
    except ValueError:  # a line past the reader's buffer limit (asyncio's LimitOverrunError)
        raise _Fail(f"event header larger than {max_bytes} bytes", "event_too_big") from None
    if not line:
        return None
    try:
        header = json.loads(line)
    except (ValueError, RecursionError):  # RecursionError: absurdly nested JSON
        raise _Fail(f"not a Wyoming event: {_excerpt(line)}", "invalid_event") from None
    if not isinstance(header, dict) or not isinstance(header.get("type"), str):
        raise _Fail(f"an event is a JSON object with a string type, got {_excerpt(line)}", "invalid_event")
    data = header.get("data") or {}
    data_length, payload_length = header.get("data_length") or 0, header.get("payload_length") or 0
    if not isinstance(data, dict) or not all(_is_size(n) for n in (data_length, payload_length)):
        raise _Fail(f"bad event header: {_excerpt(line)}", "invalid_event")
    if len(line) + data_length + payload_length > max_bytes:
        raise _Fail(f"event larger than {max_bytes} bytes", "event_too_big")
    try:
        if data_length:
            raw = await reader.readexactly(data_length)
            try:
                extra = json.loads(raw)
            except (ValueError, RecursionError):
                raise _Fail(f"event data is not JSON: {_excerpt(raw)}", "invalid_event") from None
            if not isinstance(extra, dict):
                raise _Fail("event data must be a JSON object", "invalid_event")
            data = {**data, **extra}
        payload = await reader.readexactly(payload_length) if payload_length else None
    except asyncio.IncompleteReadError:  # the client left in the middle of an event
        return None
    return Event(type=header["type"], data=data, payload=payload)


def _is_size(n) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0


def _excerpt(raw: bytes | str, limit: int = 100) -> str:
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    text = text.strip()
    return repr(text if len(text) <= limit else text[:limit] + "...")


# ---------------------------------------------------------------------------------------------------- server


class WyomingServer:
    """The Wyoming server on one app's state (``app.state``: engine, voices, limits, metrics, config)."""

    def __init__(self, state) -> None:
        self.state = state
        self.config = state.config
        self.connections: set[asyncio.Task] = set()
        self._server = AsyncServer.from_uri(self.config.wyoming.uri)
        self._zeroconf = None

    async def start(self) -> None:
        uri = self.config.wyoming.uri
        await self._server.start(lambda reader, writer: Connection(reader, writer, self))
        if self.config.api_keys:
            logger.warning("the Wyoming protocol has no authentication: api_keys do not protect %s", uri)
        if self.config.wyoming.zeroconf is not None:
            self._zeroconf = await _announce(self.config.wyoming.zeroconf, urlsplit(uri))
        logger.info("wyoming: listening on %s", uri)

    async def stop(self) -> None:
        """Stops accepting, ends every connection (their requests are aborted) and waits for them a moment."""
        if self._zeroconf is not None:
            with contextlib.suppress(Exception):
                await self._zeroconf._aiozc.async_close()  # the library's announcer has no close of its own
        await self._server.stop()
        for task in list(self.connections):
            task.cancel()
        if self.connections:
            await asyncio.wait(self.connections, timeout=5)


async def _announce(name: str, where: SplitResult):
    """mDNS (zeroconf) announcement of ``_wyoming._tcp``, which Home Assistant discovers. The address announced is
    the one listened on, or, for a wildcard (0.0.0.0), the machine's address towards the local network."""
    try:
        from wyoming.zeroconf import HomeAssistantZeroconf
    except ImportError:
        raise RuntimeError(
            "wyoming_zeroconf needs the zeroconf package: pip install 'chattts-serve[zeroconf]'"
        ) from None
    try:
        address = ipaddress.IPv4Address(where.hostname)
        host = None if address.is_unspecified else str(address)
    except ValueError:  # a name, or IPv6 (the announcer speaks IPv4)
        host = None
    announcer = HomeAssistantZeroconf(port=where.port, name=name, host=host)
    await announcer.register_server()
    logger.info("wyoming: announced as %s._wyoming._tcp.local. (%s:%d)", name, announcer.host, where.port)
    return announcer


# ---------------------------------------------------------------------------------------------------- a connection


@dataclass(slots=True)
class _Stream:
    """A streaming synthesis (``synthesize-start`` .. ``synthesize-stop``)."""

    params: SamplingParams
    segmenter: Segmenter
    out: _AudioOut
    text_chars: int = 0


@dataclass(slots=True)
class _Job:
    """One item for the speaker, in order: a ``synthesize`` (``stream`` None), a part of a stream, or the end
    of a stream (``text`` None)."""

    text: str | None
    params: SamplingParams | None = None
    stream: _Stream | None = None


@dataclass(slots=True)
class _AudioOut:
    """One audio stream to the client: ``audio-start`` before the first samples, ``audio-stop`` at the end."""

    connection: Connection
    started: bool = False
    samples: int = 0

    async def write(self, audio: np.ndarray) -> None:
        if not self.started:
            await self._start()
        pcm = to_pcm16(audio)
        step = SAMPLES_PER_CHUNK * SAMPLE_WIDTH
        for i in range(0, len(pcm), step):
            piece = pcm[i : i + step]
            chunk = AudioChunk(SAMPLE_RATE, SAMPLE_WIDTH, CHANNELS, piece, timestamp=self._ms())
            await self.connection.send(chunk.event())
            self.samples += len(piece) // SAMPLE_WIDTH

    async def stop(self) -> None:
        if not self.started:  # nothing to say still makes one (empty) audio stream
            await self._start()
        await self.connection.send(AudioStop(timestamp=self._ms()).event())

    async def _start(self) -> None:
        self.started = True
        await self.connection.send(AudioStart(SAMPLE_RATE, SAMPLE_WIDTH, CHANNELS, timestamp=0).event())

    def _ms(self) -> int:
        return self.samples * 1000 // SAMPLE_RATE


class Connection(AsyncEventHandler):
    """One client. A reader task turns events into jobs, a speaker task runs them in order; the library's own
    loop (one event at a time, synthesis included) would not notice a client leaving while it speaks."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: WyomingServer) -> None:
        super().__init__(reader, writer)
        self.server, self.st, self.cfg = server, server.state, server.config
        self.id = uuid.uuid4().hex[:12]
        # Bounded: a full queue stops the reader, the backpressure on a client that outruns synthesis.
        self.jobs: asyncio.Queue[_Job] = asyncio.Queue(maxsize=self.cfg.ws.max_pending_sentences)
        self.stream: _Stream | None = None
        self.send_lock = asyncio.Lock()
        self.speaking = False
        self.last_activity = time.monotonic()
        self.num_requests = 0
        self._next: asyncio.Future | None = None

    # ------------------------------------------------------------------ the two tasks

    async def run(self) -> None:
        task = asyncio.current_task()
        if len(self.server.connections) >= self.cfg.max_connections:
            await self._end(_Fail(f"too many connections ({self.cfg.max_connections}); retry later", "capacity"))
            return
        self.server.connections.add(task)
        reading = asyncio.create_task(self._read())
        speaking = asyncio.create_task(self._speak())
        failure = None
        try:
            done, _ = await asyncio.wait({reading, speaking}, return_when=asyncio.FIRST_COMPLETED)
            for t in done:  # the reader ends at the end of the stream; either ends with an exception
                if t.exception() is not None:
                    raise t.exception()
        except _Fail as exc:
            failure = exc
        except (_Gone, ConnectionError, OSError, asyncio.CancelledError):
            pass
        except Exception:  # a bug still ends the connection as a failure, never as a hang
            logger.exception("wyoming connection %s failed", self.id)
            failure = _Fail("internal server error", "server_error")
        finally:
            for t in (reading, speaking):
                t.cancel()  # cancelling the speaker aborts its engine request
            await asyncio.gather(reading, speaking, return_exceptions=True)
            if self._next is not None:
                self._next.cancel()
            await self._end(failure)
            self.server.connections.discard(task)

    async def _end(self, failure: _Fail | None) -> None:
        if failure is not None:
            logger.info("wyoming connection %s: %s (%s)", self.id, failure.text, failure.code)
            with contextlib.suppress(_Gone):
                await self.send(Error(text=failure.text[:_MAX_ERROR_CHARS], code=failure.code).event())
        self.writer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.writer.wait_closed(), 5)

    async def _read(self) -> None:
        while (event := await self._next_event()) is not None:
            await self.handle_event(event)

    async def _next_event(self) -> Event | None:
        """The next event; ``_Fail`` once the client has been idle for ``ws_idle_timeout_s``. The read itself is
        never cancelled by the idle check (that would lose half an event)."""
        if self._next is None:
            self._next = asyncio.ensure_future(read_event(self.reader, self.cfg.ws.max_message_bytes))
        while True:
            wait = self._idle_left()
            if wait <= 0:
                idle = self.cfg.ws.idle_timeout_s
                raise _Fail(f"no event for {idle:g} s while nothing was being spoken", "idle_timeout")
            done, _ = await asyncio.wait({self._next}, timeout=wait)
            if done:
                reading, self._next = self._next, None
                self.last_activity = time.monotonic()
                return reading.result()

    def _idle_left(self) -> float:
        timeout = self.cfg.ws.idle_timeout_s
        if self.speaking or not self.jobs.empty():
            return timeout  # the clock does not run while audio is being made
        return self.last_activity + timeout - time.monotonic()

    async def send(self, event: Event) -> None:
        """One event to the client, within ``send_timeout_s`` (a client that stopped reading is cut off)."""
        async with self.send_lock:
            try:
                await asyncio.wait_for(async_write_event(event, self.writer), self.cfg.timeouts.send_s)
            except (TimeoutError, ConnectionError, OSError, RuntimeError):
                raise _Gone from None

    # ------------------------------------------------------------------ events

    async def handle_event(self, event: Event) -> bool:
        kind = event.type
        if Describe.is_type(kind):
            await self.send(self._info().event())
        elif Ping.is_type(kind):
            text = event.data.get("text")
            await self.send(Pong(text=text if isinstance(text, str) else None).event())
        elif SynthesizeStart.is_type(kind):
            if self.stream is not None:
                raise _Fail("synthesize-start while a stream is open", "invalid_event")
            self.stream = _Stream(self._params(event.data), Segmenter(self.cfg.max_input_chars), _AudioOut(self))
        elif SynthesizeChunk.is_type(kind):
            await self._take_text(event.data.get("text"))
        elif SynthesizeStop.is_type(kind):
            stream, self.stream = self._open_stream("synthesize-stop"), None
            for part in stream.segmenter.flush():
                await self._queue_part(stream, part)
            await self.jobs.put(_Job(None, stream=stream))
        elif Synthesize.is_type(kind):
            if self.stream is None:  # else: the whole text again, sent alongside a stream for older servers
                text = event.data.get("text")
                if not isinstance(text, str):
                    raise _Fail("synthesize needs a text", "invalid_event")
                try:
                    check_length(text, self.cfg.max_input_chars, "text")
                except APIError as exc:
                    raise _fail_from(exc) from None
                await self.jobs.put(_Job(text, self._params(event.data)))
        else:
            logger.debug("wyoming connection %s: ignored a %r event", self.id, kind)
        return True

    def _open_stream(self, kind: str) -> _Stream:
        if self.stream is None:
            raise _Fail(f"{kind} without synthesize-start", "invalid_event")
        return self.stream

    async def _take_text(self, text) -> None:
        stream = self._open_stream("synthesize-chunk")
        if not isinstance(text, str):
            raise _Fail("synthesize-chunk needs a text", "invalid_event")
        stream.text_chars += len(text)
        if stream.text_chars > self.cfg.ws.max_text_chars:
            raise _Fail(f"the stream's text exceeds {self.cfg.ws.max_text_chars} characters", "text_limit")
        for part in stream.segmenter.feed(text):
            await self._queue_part(stream, part)

    async def _queue_part(self, stream: _Stream, part: str) -> None:
        if speakable(part):
            await self.jobs.put(_Job(part, stream=stream))  # blocks while the queue is full: backpressure

    def _params(self, data: dict) -> SamplingParams:
        """The request's voice (a saved voice, an OpenAI voice name, or the server's default voice) and options
        (the server's defaults, the ``chattts`` extension, the voice's language)."""
        voice = data.get("voice") or {}
        options = data.get("chattts") or {}
        if not isinstance(voice, dict) or not isinstance(options, dict):
            raise _Fail("voice and chattts must be JSON objects", "invalid_event")
        name, language = voice.get("name"), voice.get("language")
        if not isinstance(name, (str, type(None))) or not isinstance(language, (str, type(None))):
            raise _Fail("a voice's name and language are strings", "invalid_event")
        try:
            opts = ChatTTSOptions(**options)
            lang = (language or "").split("-")[0].split("_")[0].lower()
            if opts.lang is None and lang in LANGUAGES:
                opts = opts.model_copy(update={"lang": lang})
            chosen = resolve_voice(self.st.voices, self.st.engine, name, self.cfg.voices.default, "voice")
            return build_params(opts, chosen, defaults=request_defaults(self.cfg.default_options))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(x) for x in first.get("loc", ()))
            raise _Fail(f"chattts.{where}: {first['msg']}", "invalid_request") from None
        except APIError as exc:
            raise _fail_from(exc) from None

    def _info(self) -> Info:
        try:
            saved = self.st.voices.list(limit=self.cfg.voices.max_count)
        except VoiceStoreError as exc:  # describe still answers, with the built-in voices
            logger.error("wyoming describe: voices database: %s", exc)
            saved = []
        voices = [_voice(v.name, v.description or f"saved voice ({v.kind})") for v in saved]
        names = {v.name for v in saved}
        voices += [_voice(name, f"{name} (OpenAI voice name)") for name in BUILTIN_VOICES if name not in names]
        program = TtsProgram(
            name=PROGRAM,
            attribution=_CHATTTS,
            installed=True,
            description="ChatTTS text to speech (chattts-serve)",
            version=__version__,
            voices=voices,
            supports_synthesize_streaming=True,
        )
        return Info(tts=[program])

    # ------------------------------------------------------------------ speaking

    async def _speak(self) -> None:
        while True:
            job = await self.jobs.get()
            self.speaking = True
            try:
                await self._run(job)
            finally:
                self.speaking = False
                self.last_activity = time.monotonic()  # the idle clock starts when the audio is out

    async def _run(self, job: _Job) -> None:
        if job.stream is None:  # synthesize
            out = _AudioOut(self)
            if speakable(job.text):
                try:
                    await self._synthesize(job.text, job.params, out)
                except APIError as exc:
                    raise _fail_from(exc) from None
            await out.stop()
        elif job.text is None:  # the end of a stream
            await job.stream.out.stop()
            await self.send(SynthesizeStopped().event())
        else:
            try:
                await self._synthesize(job.text, job.stream.params, job.stream.out, job.stream)
            except APIError as exc:
                if exc.status_code != 400:
                    raise _fail_from(exc) from None
                # This sentence only (the engine refused its text): say so and go on with the next one.
                await self.send(Error(text=f"skipped {_excerpt(job.text)}: {exc.detail}"[:_MAX_ERROR_CHARS]).event())

    async def _synthesize(self, text: str, params: SamplingParams, out: _AudioOut, stream: _Stream | None = None):
        """One engine request, its audio sent as it comes. In a stream, the first part's audio becomes every later
        part's voice (as over the WebSocket: text that arrives in pieces keeps one voice)."""
        resp = AudioResponse(self.st.engine, self.st.metrics, self.st.limits, "wyoming", self.cfg.timeouts.queue_wait_s)
        self.num_requests += 1
        await resp.start(text, params, self.st.engine.stream_policy, f"wyoming-{self.id}-{self.num_requests}")
        first_part_audio = [] if stream is not None and voice_from_first_part(params) else None
        try:
            async with aclosing(resp.chunks()) as chunks:  # closing it (cancelled, failed) aborts the request
                async for chunk in chunks:
                    if len(chunk.audio):
                        await out.write(chunk.audio)
                    if first_part_audio is not None:
                        first_part_audio.append(chunk.audio)
                        if chunk.finished and chunk.finish_reason in ("stop", "length"):
                            stream.params = await with_first_part_voice(self.st, params, chunk, first_part_audio)
        except (APIError, EngineError, EngineDeadError) as exc:  # it failed after it started
            logger.error("wyoming request failed: %s", getattr(exc, "detail", exc))
            raise _Fail("synthesis failed; the server log has the cause", "synthesis_failed") from None


def _voice(name: str, description: str) -> TtsVoice:
    return TtsVoice(
        name=name,
        attribution=_SERVER,
        installed=True,
        description=description,
        version=None,
        languages=list(LANGUAGES),
    )
