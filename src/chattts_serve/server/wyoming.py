"""The Wyoming protocol (Home Assistant's voice pipeline): ``chattts-serve wyoming --uri tcp://HOST:PORT``, or
``chattts-serve serve --wyoming-uri ...`` next to the HTTP API on the same engine.

Events are the ``wyoming`` package's own types and its server loop accepts the connections:

* ``describe`` -> ``info``: one TTS program, the served family's (``chattts``, ``vits``, ``kokoro``: its model's
  attribution and sample rate), with the family's built-in voices (ChatTTS: OpenAI's names, zh and en; Kokoro:
  its packs, each in its language; VITS: its speakers, in the checkpoint's language) and the first
  ``DESCRIBED_SAVED_VOICES`` saved voices (names only), ``supports_synthesize_streaming``.
  Anyone may ask, so the answer is cached, built off the event loop, and sent at most once a second per
  connection.
* ``synthesize {text, voice: {name}}`` -> ``audio-start`` (the model's rate, 16-bit, mono), ``audio-chunk``s as
  the engine makes them, ``audio-stop``.
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
from urllib.parse import SplitResult, urlsplit

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
from ..engine.outputs import RequestOutput
from ..sampling_params import SamplingParams
from .errors import APIError, check_length
from .params import resolve_voice, server_params
from .protocol import ChatTTSOptions
from .text_session import (
    MAX_ERROR_CHARS,
    ErrorKind,
    Gone,
    SessionError,
    TextSession,
    TextStream,
    error_from_api,
    excerpt,
)
from .voices import VoiceStoreError

logger = logging.getLogger(__name__)

LANGUAGES = ["zh", "en"]
"""A voice's language that sets a request's ``lang`` (the common option: ChatTTS's normaliser, Kokoro's G2P)."""
SAMPLE_WIDTH = 2  # bytes: 16-bit PCM
CHANNELS = 1
SAMPLES_PER_CHUNK = 1024
YIELD_EVERY_EVENTS = 16
"""A long delta's audio-chunk events give the event loop a turn this often: a local client's socket always has
room, so sending never suspends, and a 10-minute delta (14,000 events) would otherwise hold the loop whole."""
"""Audio is sent in events of at most this many samples (43 ms), as the Wyoming TTS servers do: a player
starts on the first small one instead of waiting for a whole engine chunk (up to seconds)."""
DESCRIBED_SAVED_VOICES = 100
"""At most this many saved voices (the first by name) are listed in ``info``, after the built-in ones: describe
needs no key, so its answer must stay small however many voices the store holds (a client that needs them all
reads ``GET /v1/voices``; any saved voice can be named in ``synthesize``, listed or not)."""
DESCRIBE_INTERVAL_S = 1.0
"""A connection gets at most one ``info`` per this many seconds; a faster ``describe`` waits its turn."""
INFO_MAX_AGE_S = 10.0
"""The cached ``info`` is rebuilt when the voice store changes, and at least this often (a write by another
process on the same database file does not reach this process's store's version counter)."""
_SERVER = Attribution(name="chattts-serve", url="https://github.com/2noise/ChatTTS")


def _bad(message: str, code: str = "invalid_event") -> SessionError:
    return SessionError(ErrorKind.BAD_INPUT, message, code)


def _too_large(message: str) -> SessionError:
    return SessionError(ErrorKind.TOO_LARGE, message, "event_too_big")


# ---------------------------------------------------------------------------------------------------- reading


async def read_event(reader: asyncio.StreamReader, max_bytes: int) -> Event | None:
    """The next event (the protocol's framing: a JSON header line, then ``data_length`` bytes of JSON data and
    ``payload_length`` bytes of payload); None at the end of the stream. The library's own reader turns a
    malformed event into the end of the stream and reads any length a header announces; this one says what is
    wrong (``SessionError``) and refuses an event larger than ``max_bytes`` before reading it."""
    try:
        line = await reader.readline()
    except ValueError:  # a line past the reader's buffer limit (asyncio's LimitOverrunError)
        raise _too_large(f"event header larger than {max_bytes} bytes") from None
    if not line:
        return None
    try:
        header = json.loads(line)
    except (ValueError, RecursionError):  # RecursionError: absurdly nested JSON
        raise _bad(f"not a Wyoming event: {excerpt(line)}") from None
    if not isinstance(header, dict) or not isinstance(header.get("type"), str):
        raise _bad(f"an event is a JSON object with a string type, got {excerpt(line)}")
    data = header.get("data") or {}
    data_length, payload_length = header.get("data_length") or 0, header.get("payload_length") or 0
    if not isinstance(data, dict) or not all(_is_size(n) for n in (data_length, payload_length)):
        raise _bad(f"bad event header: {excerpt(line)}")
    if len(line) + data_length + payload_length > max_bytes:
        raise _too_large(f"event larger than {max_bytes} bytes")
    try:
        if data_length:
            raw = await reader.readexactly(data_length)
            try:
                extra = json.loads(raw)
            except (ValueError, RecursionError):
                raise _bad(f"event data is not JSON: {excerpt(raw)}") from None
            if not isinstance(extra, dict):
                raise _bad("event data must be a JSON object")
            data = {**data, **extra}
        payload = await reader.readexactly(payload_length) if payload_length else None
    except asyncio.IncompleteReadError:  # the client left in the middle of an event
        return None
    return Event(type=header["type"], data=data, payload=payload)


def _is_size(n) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0


# ---------------------------------------------------------------------------------------------------- server


class WyomingServer:
    """The Wyoming server on one app's state (``app.state``: engine, voices, limits, metrics, config)."""

    def __init__(self, state) -> None:
        self.state = state
        self.config = state.config
        self.connections: set[asyncio.Task] = set()
        self._server = AsyncServer.from_uri(self.config.wyoming.uri)
        self._zeroconf = None
        self._info: tuple[int, float, Event] | None = None  # (store version, built at, info event)
        self._info_lock = asyncio.Lock()

    async def info(self) -> Event:
        """The ``info`` event, cached: rebuilt (in a worker thread: the voice store is a blocking database)
        only when the voices changed or it is older than ``INFO_MAX_AGE_S``, by one caller at a time."""
        async with self._info_lock:
            version = self.state.voices.version
            cached = self._info
            if cached is None or cached[0] != version or time.monotonic() - cached[1] > INFO_MAX_AGE_S:
                event = (await asyncio.to_thread(_build_info, self.state.voices, self.state.engine)).event()
                self._info = cached = (version, time.monotonic(), event)
            return cached[2]

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


class _AudioOut:
    """A stream's sink: one audio stream to the client, ``audio-start`` before the first samples and
    ``audio-stop`` at the end. ``streaming`` (``synthesize-start`` .. ``synthesize-stop``): then
    ``synthesize-stopped``, and a sentence the engine refuses is skipped; a ``synthesize`` it refuses fails."""

    def __init__(self, connection: Connection, streaming: bool, rate: int) -> None:
        """``rate``: the model's sample rate (the audio is sent as the model makes it)."""
        self.connection, self.streaming, self.rate = connection, streaming, rate
        self.started = False
        self.samples = 0

    async def audio(self, part: int, chunk: RequestOutput) -> None:
        if not len(chunk.audio):
            return
        if not self.started:
            await self._start()
        pcm = to_pcm16(chunk.audio)
        step = SAMPLES_PER_CHUNK * SAMPLE_WIDTH
        for n, i in enumerate(range(0, len(pcm), step), 1):
            piece = pcm[i : i + step]
            event = AudioChunk(self.rate, SAMPLE_WIDTH, CHANNELS, piece, timestamp=self._ms()).event()
            await self.connection.send(event)
            self.samples += len(piece) // SAMPLE_WIDTH
            if n % YIELD_EVERY_EVENTS == 0:
                await asyncio.sleep(0)

    def part_done(self) -> None:
        pass

    async def refused(self, part: int, text: str, error: SessionError) -> None:
        if not self.streaming:
            raise error
        skipped = excerpt(f"skipped {excerpt(text)}: {error.message}", MAX_ERROR_CHARS)
        await self.connection.send(Error(text=skipped).event())

    async def end(self) -> None:
        if not self.started:  # nothing to say still makes one (empty) audio stream
            await self._start()
        await self.connection.send(AudioStop(timestamp=self._ms()).event())
        if self.streaming:
            await self.connection.send(SynthesizeStopped().event())

    async def _start(self) -> None:
        self.started = True
        await self.connection.send(AudioStart(self.rate, SAMPLE_WIDTH, CHANNELS, timestamp=0).event())

    def _ms(self) -> int:
        return self.samples * 1000 // self.rate


class Connection(AsyncEventHandler):
    """One client: the Wyoming framing of a ``TextSession`` (``server.text_session``), whose reader task turns
    events into streams and whose speaker speaks them in order; the library's own loop (one event at a time,
    synthesis included) would not notice a client leaving while it speaks."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: WyomingServer) -> None:
        super().__init__(reader, writer)
        self.server, self.st, self.cfg = server, server.state, server.config
        self.session = TextSession(self.st, "wyoming", request_prefix="wyoming-")
        self.stream: TextStream | None = None
        self.send_lock = asyncio.Lock()
        self.last_describe = -DESCRIBE_INTERVAL_S

    async def run(self) -> None:
        task = asyncio.current_task()
        if len(self.server.connections) >= self.cfg.max_connections:
            message = f"too many connections ({self.cfg.max_connections}); retry later"
            await self._end(SessionError(ErrorKind.OVERLOADED, message, "capacity"))
            return
        self.server.connections.add(task)
        failure = None
        try:
            failure = await self.session.run(self._read)
        except asyncio.CancelledError:  # the server is stopping
            pass
        finally:
            await self._end(failure)
            self.server.connections.discard(task)

    async def _end(self, failure: SessionError | None) -> None:
        if failure is not None:
            logger.info("wyoming connection %s: %s (%s)", self.session.id, failure.message, failure.code)
            with contextlib.suppress(Gone):
                await self.send(Error(text=failure.message, code=failure.code).event())
        self.writer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.writer.wait_closed(), 5)

    async def _read(self) -> None:
        while (event := await self.session.receive(self._read_event)) is not None:
            await self.handle_event(event)
        raise Gone  # the end of the stream (the client left, or half-closed): its requests are aborted

    async def _read_event(self) -> Event | None:
        try:
            return await read_event(self.reader, self.cfg.ws.max_message_bytes)
        except OSError:  # ConnectionResetError and the like
            raise Gone from None

    async def send(self, event: Event) -> None:
        """One event to the client, within ``send_timeout_s`` (a client that stopped reading is cut off)."""
        async with self.send_lock:
            try:
                await asyncio.wait_for(async_write_event(event, self.writer), self.cfg.timeouts.send_s)
            except (TimeoutError, ConnectionError, OSError, RuntimeError):
                raise Gone from None

    # ------------------------------------------------------------------ events

    async def handle_event(self, event: Event) -> bool:
        kind, data = event.type, event.data
        policy = self.st.engine.stream_policy
        if Describe.is_type(kind):
            wait = self.last_describe + DESCRIBE_INTERVAL_S - time.monotonic()
            if wait > 0:  # throttled: the reader waits, so a flood of describes is read no faster than this
                await asyncio.sleep(wait)
            self.last_describe = time.monotonic()
            await self.send(await self.server.info())
        elif Ping.is_type(kind):
            text = data.get("text")
            await self.send(Pong(text=text if isinstance(text, str) else None).event())
        elif SynthesizeStart.is_type(kind):
            if self.stream is not None:
                raise _bad("synthesize-start while a stream is open")
            params = await asyncio.to_thread(self._params, data)  # voices: store reads, blends
            self.stream = self.session.stream(
                params, policy, _AudioOut(self, streaming=True, rate=self.st.engine.sample_rate)
            )
        elif SynthesizeChunk.is_type(kind):
            stream, text = self._open_stream("synthesize-chunk"), data.get("text")
            if not isinstance(text, str):
                raise _bad("synthesize-chunk needs a text")
            await stream.feed(text)
        elif SynthesizeStop.is_type(kind):
            stream, self.stream = self._open_stream("synthesize-stop"), None
            await stream.end()
        elif Synthesize.is_type(kind):
            if self.stream is None:  # else: the whole text again, sent alongside a stream for older servers
                text = data.get("text")
                if not isinstance(text, str):
                    raise _bad("synthesize needs a text")
                try:
                    check_length(text, self.cfg.max_input_chars, "text")
                except APIError as exc:
                    raise error_from_api(exc) from None
                out = _AudioOut(self, streaming=False, rate=self.st.engine.sample_rate)
                params = await asyncio.to_thread(self._params, data)
                await self.session.stream(params, policy, out, keep_first_voice=False).say(text)
        else:
            logger.debug("wyoming connection %s: ignored a %r event", self.session.id, kind)
        return True

    def _open_stream(self, kind: str) -> TextStream:
        if self.stream is None:
            raise _bad(f"{kind} without synthesize-start")
        return self.stream

    def _params(self, data: dict) -> SamplingParams:
        """The request's voice (a saved voice, an OpenAI voice name, or the server's default voice) and options
        (the server's defaults, the ``chattts`` extension, the voice's language)."""
        voice = data.get("voice") or {}
        options = data.get("chattts") or {}
        if not isinstance(voice, dict) or not isinstance(options, dict):
            raise _bad("voice and chattts must be JSON objects")
        name, language = voice.get("name"), voice.get("language")
        if not isinstance(name, (str, type(None))) or not isinstance(language, (str, type(None))):
            raise _bad("a voice's name and language are strings")
        try:
            opts = ChatTTSOptions(**options)
            lang = (language or "").split("-")[0].split("_")[0].lower()
            if opts.lang is None and lang in LANGUAGES:
                opts = opts.model_copy(update={"lang": lang})
            chosen = resolve_voice(self.st.voices, self.st.engine, name, self.cfg.voices.default, "voice")
            return server_params(self.st, opts, chosen)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(x) for x in first.get("loc", ()))
            raise _bad(f"chattts.{where}: {first['msg']}", "invalid_request") from None
        except APIError as exc:
            raise error_from_api(exc) from None


def _build_info(store, engine) -> Info:
    """The served family's program (its name, its model's attribution and rate) with its built-in voices (their
    descriptions and languages are the family's, ``models.family.Voices``), then at most ``DESCRIBED_SAVED_VOICES``
    saved ones, by name only: a saved voice's description is the client's text and stays out of an answer anyone
    may ask for. A saved voice speaks the built-in voices' languages (it holds a voice string of the same model)."""
    try:
        saved = [v.name for v in store.list(limit=DESCRIBED_SAVED_VOICES)]
    except VoiceStoreError as exc:  # describe still answers, with the built-in voices
        logger.error("wyoming describe: voices database: %s", exc)
        saved = []
    family, catalogue = engine.family, engine.voices
    attribution = _SERVER if family.attribution is None else Attribution(*family.attribution)
    builtin = [name for name in catalogue.builtin if name not in saved]
    voices = [_voice(name, catalogue.description(name), catalogue.languages(name)) for name in builtin]
    spoken = tuple(dict.fromkeys(tag for name in catalogue.builtin for tag in catalogue.languages(name)))
    voices += [_voice(name, "saved voice", spoken) for name in saved]
    program = TtsProgram(
        name=family.name,
        attribution=attribution,
        installed=True,
        description=f"{family.title or family.name} text to speech, {engine.sample_rate} Hz (chattts-serve)",
        version=__version__,
        voices=voices,
        supports_synthesize_streaming=True,
    )
    return Info(tts=[program])


def _voice(name: str, description: str, languages: tuple[str, ...]) -> TtsVoice:
    return TtsVoice(
        name=name,
        attribution=_SERVER,
        installed=True,
        description=description,
        version=None,
        languages=list(languages),
    )
