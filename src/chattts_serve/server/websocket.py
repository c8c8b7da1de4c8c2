"""The WebSocket ``/v1/tts/stream``: text in, optionally in pieces (as a language model writes it); audio
chunks out with small JSON events.

WebSocket protocol: the client sends ``{"type": "start", ...options}`` (the options of ``POST /v1/tts``;
``text`` optional), then any number of ``{"type": "text", "text": ...}`` and finally ``{"type": "end"}``. The
server answers ``{"type": "start", ...}``, then for each audio piece a ``{"type": "chunk", "bytes": n, ...}``
event followed by exactly one binary frame of n bytes (none when n is 0), and finally ``{"type": "end"}`` and a
close with 1000. Text is spoken a part at a time: everything up to the last sentence end (。！？!?.\\n) received
so far is one part.

Every session ends with ``end`` + 1000, or with an error event ``{"type": "error", "message", "code",
"fatal": true}`` and a close with one of the codes below. The one error event that is not the end (``"fatal":
false``, with ``part`` and ``text``) reports a part the engine refused (400, e.g. text it cannot speak); that
part is skipped and the session goes on. Error messages are short (at most 300 characters) and quote at most
100 characters of the client's message at fault.

What happens at each limit (``ServerConfig``):

* ``allowed_hosts``: a handshake whose ``Host`` is not listed is refused (HTTP 403), as HTTP requests are.
* ``allowed_origins``: a handshake with an ``Origin`` header is refused (HTTP 403, nothing read) unless the
  origin is listed (``*``: any), or, when the list is empty, has the host:port of the ``Host`` header (same
  origin). Clients without ``Origin`` (not browsers) are accepted.
* ``api_keys``: a missing or wrong key gets error ``invalid_api_key`` + 1008.
* ``ws_max_message_bytes``: a larger message (the start message included) gets error ``message_too_big`` + 1009.
  A message also over the protocol layer's cap (uvicorn's ``ws_max_size``, set by ``chattts-serve serve``) is
  refused there, before it is buffered whole: close 1009 without the event.
* ``ws_max_text_chars``: once the session's text (the start's included) exceeds it: error ``text_limit`` + 1008.
* ``max_input_chars``: the start's ``text`` is checked as in ``POST /v1/tts`` (longer: error + 1008). Later text
  is cut into parts of at most this many characters: at the last sentence end that fits, else at the last
  space or comma in the second half of the limit, else at the limit itself. A run without a sentence end is
  spoken in such pieces as soon as it is longer than the limit; nothing is refused or dropped.
* ``ws_max_pending_sentences``: parts waiting to be spoken. When the client outruns synthesis the server stops
  reading (backpressure: the messages wait in the socket buffers and, once those are full, the client's sends
  block) and reads on as parts are spoken. Nothing is dropped and the session is not closed.
* ``ws_idle_timeout_s``: a session that sends nothing for this long while nothing is being spoken or waiting
  (before its start message too) gets error ``idle_timeout`` + 1001.
* Binary frames are not part of the protocol: error ``binary_frame`` + 1003.
* A message that is not JSON, a start message that does not validate, an unknown message type: error + 1008.
* Synthesis that fails once started (``StreamFailed``, engine errors, the engine stopped): error + 1011 (never an
  ``end``); no capacity (429/503 ``capacity``): error + 1013, try again later; the server stopping before the
  audio was done: error ``server_shutdown`` + 1012.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import aclosing
from urllib.parse import urlsplit

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from pydantic import ValidationError

from ..audio.encode import StreamingEncoder
from ..engine.async_engine import EngineDeadError, EngineError
from ..model.config import SAMPLE_RATE
from .audio_response import AudioResponse
from .errors import APIError
from .native import _voice_and_params
from .protocol import TTSRequest
from .service import key_matches
from .text_parts import Segmenter, speakable, voice_from_first_part, with_first_part_voice

router = APIRouter()
logger = logging.getLogger(__name__)
_NO_INITIAL_TEXT = "-"
"""Stands in for the required ``text`` when a WebSocket start message has none; only validated, never spoken."""
_ECHO_CHARS = 100
_MAX_ERROR_CHARS = 300
MAX_FRAME_SAMPLES = 5 * SAMPLE_RATE  # at most 240 KB of 16-bit PCM per binary frame
_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}


class _Close(Exception):
    """Ends the session: an error event with ``code``, then a close with ``close_code``."""

    def __init__(self, message: str, code: str, close_code: int) -> None:
        super().__init__(message)
        self.message, self.code, self.close_code = message, code, close_code


class _Gone(Exception):
    """The client has closed the connection: nothing more can be sent."""


@router.websocket("/v1/tts/stream")
async def tts_stream(ws: WebSocket):
    cfg = ws.app.state.config
    if not _handshake_allowed(ws.headers, cfg):
        # Closing before accepting refuses the handshake (HTTP 403): a foreign page gets no session at all.
        await ws.close(code=1008)
        return
    await ws.accept()
    if cfg.api_keys and not key_matches(_ws_api_key(ws), cfg.api_keys):
        await _send_error(ws, _Close("missing or invalid API key", "invalid_api_key", 1008))
        return
    session = _Session(ws)
    try:
        await session.open()
        await session.run()
    except _Gone:
        pass
    except _Close as close:
        await session.close_with(close)
    except Exception:  # a bug must still end the session as a failure, never hang or look like success
        logger.exception("websocket session %s failed", session.id)
        await session.close_with(_Close("internal server error", "server_error", 1011))


def _ws_api_key(ws: WebSocket) -> str:
    """The header's key, else ``?api_key=`` (browsers cannot give a WebSocket headers)."""
    auth = ws.headers.get("authorization", "")
    return auth[7:].strip() if auth.lower().startswith("bearer ") else ws.query_params.get("api_key", "")


def _handshake_allowed(headers, cfg) -> bool:
    host = headers.get("host", "")
    # The HTTP middleware's host check (DNS rebinding) does not see WebSockets: the same rule here. Without
    # it a rebound name would pass the origin check too (page and Host would both be the attacker's name).
    if cfg.allowed_hosts and host.rsplit(":", 1)[0] not in cfg.allowed_hosts:
        return False
    return _origin_allowed(headers.get("origin"), host, cfg.allowed_origins)


def _origin_allowed(origin: str | None, host: str, allowed: tuple[str, ...]) -> bool:
    """Browsers always send ``Origin`` on a WebSocket handshake, and a page of any site may open one: without
    this check any web page a user visits could use the server (and its API key in the page's URL)."""
    if origin is None:
        return True  # not a browser: the check protects browsers' users only
    if allowed:
        return "*" in allowed or _norm_origin(origin) in {_norm_origin(o) for o in allowed}
    return _same_origin(origin, host)


def _norm_origin(origin: str) -> str:
    return origin.strip().rstrip("/").lower()


def _same_origin(origin: str, host: str) -> bool:
    """The origin's host:port is the Host header's (a missing port is the scheme's default)."""
    try:
        o, h = urlsplit(origin.strip()), urlsplit("//" + host.strip())
        default = _DEFAULT_PORTS.get(o.scheme)
        return o.hostname is not None and (o.hostname, o.port or default) == (h.hostname, h.port or default)
    except ValueError:  # a malformed port
        return False


class _Session:
    """One WebSocket session: a reader task turns messages into parts (``text_parts.Segmenter``) and queues them, a
    speaker task synthesizes them in order. Either may end the session (``_Close``); the other is cancelled
    (cancelling the speaker aborts its engine request)."""

    def __init__(self, ws: WebSocket) -> None:
        self.ws, self.st = ws, ws.app.state
        self.cfg = self.st.config
        self.id = uuid.uuid4().hex[:12]
        # Bounded: a full queue stops the reader, which is the backpressure on a client that outruns synthesis.
        self.parts: asyncio.Queue[str | None] = asyncio.Queue(maxsize=self.cfg.ws.max_pending_sentences)
        self.segmenter = Segmenter(self.cfg.max_input_chars)
        # One sender at a time: a chunk event and its binary frame must never have an error event between them.
        self.send_lock = asyncio.Lock()
        self.speaking = False
        self.last_activity = time.monotonic()
        self.text_chars = 0
        self.part = 0
        self.chunks = 0
        self.samples = 0
        self.initial = ""

    # ------------------------------------------------------------------ start

    async def open(self) -> None:
        """Reads and validates the start message, answers with the start event."""
        raw = await self._receive_text()
        try:
            first = json.loads(raw)
            if not isinstance(first, dict) or first.pop("type", None) != "start":
                raise ValueError('the first message must be {"type": "start", ...options}')
            # The initial text is optional (it may all come in "text" messages), but TTSRequest requires one: a
            # start without it is validated with a placeholder that is never spoken. A text that is given, "-"
            # included, is validated and kept as it is.
            has_initial_text = "text" in first
            first.setdefault("text", _NO_INITIAL_TEXT)
            first.setdefault("format", "pcm")
            self.body = TTSRequest(**first)
            self.params, self.policy = _voice_and_params(self.st, self.body)
        except (ValueError, ValidationError, APIError, RecursionError, TypeError) as exc:
            raise _Close(str(getattr(exc, "detail", exc)), "invalid_request", 1008) from None
        self.initial = self.body.text if has_initial_text else ""
        start = {"type": "start", "session_id": self.id, "format": self.body.format, "sample_rate": SAMPLE_RATE}
        await self._send(start)

    # ------------------------------------------------------------------ the two tasks

    async def run(self) -> None:
        reading = asyncio.create_task(self._read())
        speaking = asyncio.create_task(self._speak())
        try:
            await _until_done(reading, speaking)
        finally:
            for task in (reading, speaking):
                task.cancel()
            await asyncio.gather(reading, speaking, return_exceptions=True)

    async def _read(self) -> None:
        await self._take_text(self.initial)
        while True:
            msg = _parse(await self._receive_text())
            if msg["type"] == "end":
                for part in self.segmenter.flush():
                    await self._queue(part)
                await self.parts.put(None)
                return
            await self._take_text(msg["text"])

    async def _take_text(self, text: str) -> None:
        self.text_chars += len(text)
        if self.text_chars > self.cfg.ws.max_text_chars:
            raise _Close(f"the session's text exceeds {self.cfg.ws.max_text_chars} characters", "text_limit", 1008)
        for part in self.segmenter.feed(text):
            await self._queue(part)

    async def _queue(self, part: str) -> None:
        if part.strip() and speakable(part):
            await self.parts.put(part)  # blocks while the queue is full: backpressure

    async def _speak(self) -> None:
        while (text := await self.parts.get()) is not None:
            self.speaking = True
            try:
                await self._speak_part(text)
            finally:
                self.speaking = False
                self.last_activity = time.monotonic()  # the idle clock starts when the audio is out
        end = {"type": "end", "chunks": self.chunks, "audio_seconds": self.samples / SAMPLE_RATE}
        async with self.send_lock:
            await self._guard(self.ws.send_text(json.dumps(end)))
            await self._guard(self.ws.close())

    async def _speak_part(self, text: str) -> None:
        resp = AudioResponse(self.st.engine, self.st.metrics, self.st.limits, "ws", self.cfg.timeouts.queue_wait_s)
        try:
            await resp.start(text, self.params, self.policy, f"{self.id}-{self.part}")
        except APIError as exc:
            if exc.status_code != 400:
                raise _failure(exc) from None
            # This part only (the engine refused its text): say so and go on with the next one.
            refused = {"fatal": False, "part": self.part, "text": _excerpt(text)}
            await self._send(_error_event(str(exc.detail), exc.code or "invalid_request", **refused))
            return
        self.part += 1
        try:
            await self._stream_part(resp)
        except (APIError, EngineError, EngineDeadError) as exc:  # StreamFailed: it failed after it started
            raise _failure(exc) from None

    async def _stream_part(self, resp: AudioResponse) -> None:
        encoder = StreamingEncoder(self.body.format)
        first_part_audio = [] if voice_from_first_part(self.params) else None
        try:
            async with aclosing(resp.chunks()) as chunks:  # closing it (cancelled, failed) aborts the request
                async for chunk in chunks:
                    if first_part_audio is not None:
                        first_part_audio.append(chunk.audio)
                        if chunk.finished and chunk.finish_reason in ("stop", "length"):
                            self.params = await with_first_part_voice(self.st, self.params, chunk, first_part_audio)
                    # Audio that piled up while the client read slowly arrives as one delta: sent in frames of at
                    # most MAX_FRAME_SAMPLES, under the 1 MiB message limit of common clients (websockets' default).
                    pieces = range(0, max(len(chunk.audio), 1), MAX_FRAME_SAMPLES)
                    for i, start in enumerate(pieces):
                        piece = chunk.audio[start : start + MAX_FRAME_SAMPLES]
                        last = chunk.finished and i == len(pieces) - 1
                        data = encoder.write(piece) + (encoder.finish() if last else b"")
                        await self._send_chunk(len(piece), chunk.elapsed_s, data)
        finally:
            encoder.close()

    async def _send_chunk(self, samples: int, elapsed_s: float, data: bytes) -> None:
        event = {
            "type": "chunk",
            "index": self.chunks,
            "samples": samples,
            "bytes": len(data),
            "elapsed_s": round(elapsed_s, 4),
            "part": self.part - 1,
        }
        self.chunks += 1
        self.samples += samples
        # Shielded: a cancelled speaker still sends the frame its event announced (the lock keeps others out).
        sending = asyncio.ensure_future(self._send_pair(event, data))
        sending.add_done_callback(_retrieve)  # if nobody awaits it any more, its _Gone is not "never retrieved"
        await asyncio.shield(sending)

    async def _send_pair(self, event: dict, data: bytes) -> None:
        async with self.send_lock:
            await self._guard(self.ws.send_text(json.dumps(event)))
            if data:
                await self._guard(self.ws.send_bytes(data))

    # ------------------------------------------------------------------ receiving and sending

    async def _receive_text(self) -> str:
        msg = await self._receive()
        if msg["type"] == "websocket.disconnect":
            raise _Gone
        text = msg.get("text")
        if text is None:
            raise _Close("binary frames are not accepted: send JSON text messages", "binary_frame", 1003)
        limit = self.cfg.ws.max_message_bytes
        if _utf8_longer_than(text, limit):
            raise _Close(f"message larger than {limit} bytes", "message_too_big", 1009)
        return text

    async def _receive(self) -> dict:
        """The next message; ``_Close`` once the client has been idle for ``ws_idle_timeout_s``."""
        while True:
            wait = self._idle_left()
            if wait <= 0:
                idle = self.cfg.ws.idle_timeout_s
                raise _Close(f"no message for {idle:g} s while nothing was being spoken", "idle_timeout", 1001)
            try:
                msg = await asyncio.wait_for(self.ws.receive(), wait)
            except asyncio.TimeoutError:
                continue  # check again: speech may have started or ended meanwhile
            self.last_activity = time.monotonic()
            return msg

    def _idle_left(self) -> float:
        timeout = self.cfg.ws.idle_timeout_s
        if self.speaking or not self.parts.empty():
            return timeout  # the clock does not run while audio is being made
        return self.last_activity + timeout - time.monotonic()

    async def _send(self, event: dict) -> None:
        async with self.send_lock:
            await self._guard(self.ws.send_text(json.dumps(event)))

    @staticmethod
    async def _guard(sending) -> None:
        """Awaits a send or close; a client that has gone away becomes ``_Gone``."""
        try:
            await sending
        except (WebSocketDisconnect, RuntimeError, OSError):
            raise _Gone from None

    async def close_with(self, close: _Close) -> None:
        async with self.send_lock:
            await _send_error(self.ws, close)


async def _until_done(reading: asyncio.Task, speaking: asyncio.Task) -> None:
    """Returns when the speaker has finished (the end was sent); raises what ended either task first."""
    pending = {reading, speaking}
    while speaking in pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            if task.exception() is not None:
                raise task.exception()


def _retrieve(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()


def _failure(exc: Exception) -> _Close:
    """A synthesis that could not run or failed midway ends the session (it must not look like success)."""
    if isinstance(exc, APIError):
        if exc.code == "capacity":
            return _Close(str(exc.detail), "capacity", 1013)
        if exc.code == "server_shutdown":  # 1012 Service Restart: the client may reconnect elsewhere
            return _Close(str(exc.detail), "server_shutdown", 1012)
        return _Close(str(exc.detail), exc.code or "server_error", 1011)
    logger.error("websocket synthesis failed: %s", exc)
    return _Close("synthesis failed; the server log has the cause", "synthesis_failed", 1011)


def _parse(raw: str) -> dict:
    """A later message: ``{"type": "text", "text": str}`` or ``{"type": "end"}``; anything else ends the session."""
    try:
        msg = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: absurdly nested JSON
        raise _Close(f"bad message: not JSON: {_excerpt(raw)}", "invalid_message", 1008) from None
    kind = msg.get("type") if isinstance(msg, dict) else None
    if (kind == "text" and isinstance(msg.get("text"), str)) or kind == "end":
        return msg
    raise _Close(f"bad message: unexpected message {_excerpt(raw)}", "invalid_message", 1008)


def _utf8_longer_than(text: str, limit: int) -> bool:
    # A character is 1 to 4 bytes in UTF-8: only the in-between case needs encoding.
    if len(text) > limit:
        return True
    if 4 * len(text) <= limit:
        return False
    return len(text.encode("utf-8", "surrogatepass")) > limit


def _excerpt(text: str, limit: int = _ECHO_CHARS) -> str:
    """At most ``limit`` characters of what the client sent (an error must not echo a whole message back)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _error_event(message: str, code: str, **extra) -> dict:
    return {"type": "error", "message": _excerpt(message, _MAX_ERROR_CHARS), "code": code, "fatal": True, **extra}


async def _send_error(ws: WebSocket, close: _Close) -> None:
    try:
        await ws.send_text(json.dumps(_error_event(close.message, close.code)))
        await ws.close(code=close.close_code)
    except (WebSocketDisconnect, RuntimeError, OSError):
        pass
