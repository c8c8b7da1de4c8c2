"""The WebSocket ``/v1/tts/stream``: text in, optionally in pieces (as a language model writes it); audio
chunks out with small JSON events.

WebSocket protocol: the client sends ``{"type": "start", ...options}`` (the options of ``POST /v1/tts``;
``text`` optional; ``format`` defaults to pcm, ``sample_rate`` as in ``POST /v1/tts``), then any number of
``{"type": "text", "text": ...}`` and finally ``{"type": "end"}``. The server answers ``{"type": "start",
"format", "sample_rate", ...}``, then for each audio piece a ``{"type": "chunk", "bytes": n, ...}`` event
(``samples``: at the stream's ``sample_rate``) followed by exactly one binary frame of n bytes (none when n is
0), and finally ``{"type": "end"}`` and a close with 1000. With ``"timestamps": true`` in the start message, a
``{"type": "segment", "index", "part", "text", "start_s", "end_s"}`` event follows the chunk that completes a
sentence: its place in the session's audio (parts back to back), counted in samples (``server.captions``).
Text is spoken a part at a time: everything up to the last sentence end (。！？!?.\\n) received so far is one
part. This module is the WebSocket framing of the streaming-text session that Wyoming shares
(``server.text_session``: the reader and speaker tasks, backpressure, the idle clock, the text limit).

Every session ends with ``end`` + 1000, or with an error event ``{"type": "error", "message", "code",
"fatal": true}`` and a close with one of the codes below. The one error event that is not the end (``"fatal":
false``, with ``part`` and ``text``) reports a part the engine refused (bad input, e.g. text it cannot speak);
that part is skipped and the session goes on. Error messages are short (at most 300 characters) and quote at most
100 characters of the client's message at fault.

What happens at each limit (``ServerConfig``); the handshake's checks (the first three) are ``server.auth``'s, the same
as for HTTP requests:

* ``allowed_hosts``: a handshake whose ``Host`` is not listed is refused (HTTP 403), as HTTP requests are.
* ``allowed_origins``: a handshake with an ``Origin`` header is refused (HTTP 403, nothing read) unless the
  origin is listed (``*``: any), or, when the list is empty, has the host:port of the ``Host`` header (same
  origin). Clients without ``Origin`` (not browsers) are accepted.
* ``api_keys`` (or tenants): the key is ``Authorization: Bearer`` or ``?api_key=``; a missing, wrong or ambiguous
  key (repeated headers or parameters, a header and a parameter that differ) gets error ``invalid_api_key`` + 1008.
* ``ws_max_message_bytes``: a larger message (the start message included) gets error ``message_too_big`` + 1009.
  A message also over the protocol layer's cap (uvicorn's ``ws_max_size``, set by ``chattts-serve serve``) is
  refused there, before it is buffered whole: close 1009 without the event.
* ``ws_max_text_chars``: once the session's text (the start's included) exceeds it: error ``text_limit`` + 1008.
* ``ws_max_audio_seconds``: a part that would take the stream's audio past it: error ``audio_limit`` + 1008.
* ``max_input_chars``: the start's ``text`` is checked as in ``POST /v1/tts`` (longer: error + 1008). Later text
  is cut into parts of at most this many characters: at the last sentence end that fits, else at the last
  space or comma in the second half of the limit, else at the limit itself. A run without a sentence end is
  spoken in such pieces as soon as it is longer than the limit; nothing is refused or dropped.
* ``ws_max_pending_sentences``: parts waiting to be spoken. When the client outruns synthesis the server stops
  reading (backpressure: the messages wait in the socket buffers and, once those are full, the client's sends
  block) and reads on as parts are spoken. Nothing is dropped and the session is not closed.
* ``ws_idle_timeout_s``: a session that sends nothing for this long while nothing is being spoken or waiting
  (before its start message too) gets error ``idle_timeout`` + 1001.
* ``send_timeout_s``: a send or close that the client does not take within this long (it stopped reading)
  ends the session as HTTP ends a stalled body: its request is aborted and its slot freed, with no event.
* Binary frames are not part of the protocol: error ``binary_frame`` + 1003.
* A message that is not JSON, a start message that does not validate, an unknown message type: error + 1008.
* Synthesis that fails once started (``StreamFailed``, engine errors, the engine stopped): error + 1011 (never an
  ``end``); no capacity (``capacity``): error + 1013, try again later; the server stopping before the
  audio was done: error ``server_shutdown`` + 1012.
"""

from __future__ import annotations

import asyncio
import json
import logging

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from pydantic import ValidationError

from ..audio.encode import check_rate
from ..engine.outputs import RequestOutput
from . import auth
from .audio_response import ThreadedEncoder
from .captions import SegmentClock, segment_event
from .errors import APIError
from .limits import synthesis
from .params import tenant_of, tts_params
from .protocol import TTSRequest
from .text_session import MAX_ERROR_CHARS, ErrorKind, Gone, SessionError, TextSession, TextStream, excerpt

logger = logging.getLogger(__name__)
router = APIRouter()
_NO_INITIAL_TEXT = "-"
"""Stands in for the required ``text`` when a WebSocket start message has none; only validated, never spoken."""
MAX_FRAME_SAMPLES = 120_000  # at most 240 KB of 16-bit PCM per binary frame (5 s at 24 kHz)
_CLOSE_CODES = {
    ErrorKind.BAD_INPUT: 1008,  # Policy Violation
    ErrorKind.UNSUPPORTED: 1003,  # Unsupported Data
    ErrorKind.TOO_LARGE: 1009,  # Message Too Big
    ErrorKind.OVER_LIMIT: 1008,
    ErrorKind.IDLE: 1001,  # Going Away
    ErrorKind.OVERLOADED: 1013,  # Try Again Later
    ErrorKind.SHUTDOWN: 1012,  # Service Restart: the client may reconnect elsewhere
    ErrorKind.INTERNAL: 1011,  # Internal Error
}
"""The close code for each kind of session error (an end event closes with 1000)."""


@router.websocket("/v1/tts/stream")
@synthesis
async def tts_stream(ws: WebSocket):
    who = auth.principal(ws.scope)
    if who is None or not who.authorized:
        # ``auth.Authenticate`` has answered a foreign Host or Origin and bad credentials already: this is an app
        # built without it, and nobody gets in (closing before accepting refuses the handshake).
        await ws.close(code=1008)
        return
    await ws.accept()
    framing = _Framing(ws)
    failure = await framing.session.run(framing.read)
    if failure is not None:
        await framing.close_with(failure)


class _Framing:
    """One WebSocket session: the framing of a ``TextSession`` (``server.text_session``) with one text stream.
    Reads the start message, then text and end messages; sends the audio as chunk events, each followed by its
    binary frame."""

    def __init__(self, ws: WebSocket) -> None:
        self.ws, self.st = ws, ws.app.state
        self.cfg = self.st.config
        self.session = TextSession(self.st, "ws")
        # One sender at a time: a chunk event and its binary frame must never have an error event between them.
        self.send_lock = asyncio.Lock()
        self.format, self.sample_rate = "pcm", self.st.engine.sample_rate
        self.encoder: ThreadedEncoder | None = None
        self.chunks = 0
        self.samples = 0
        self.timestamps = False
        self.stretch = 1.0  # speed_mode "stretch"/"both": each part's audio time-stretched (audio/stretch.py)
        self.clock: SegmentClock | None = None  # the current part's sentences, while timestamps are on
        self.model_samples = 0  # the session's audio so far at the model's rate: where the next part starts
        self.sentences = 0

    # ------------------------------------------------------------------ reading

    async def read(self) -> None:
        stream, initial = await self._open()
        await stream.feed(initial)
        while True:
            msg = _parse(await self._receive_text())
            if msg["type"] == "end":
                await stream.end(last=True)
                return
            await stream.feed(msg["text"])

    async def _open(self) -> tuple[TextStream, str]:
        """Reads and validates the start message, answers with the start event; the stream and its initial text."""
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
            self.timestamps = first.pop("timestamps", False)
            if not isinstance(self.timestamps, bool):
                raise ValueError("timestamps must be true or false")
            body = TTSRequest(**first)
            params, policy, self.stretch = await asyncio.to_thread(tts_params, self.st, body, tenant_of(self.ws.scope))
            if self.timestamps and self.stretch != 1.0:
                raise ValueError('timestamps need speed_mode "prompt" (timings of stretched audio are not exact)')
            rate = check_rate(body.format, body.sample_rate, self.st.engine.sample_rate)
        except (ValueError, ValidationError, APIError, RecursionError, TypeError) as exc:
            raise SessionError(ErrorKind.BAD_INPUT, str(getattr(exc, "detail", exc)), "invalid_request") from None
        self.format, self.sample_rate = body.format, rate
        start = {"type": "start", "session_id": self.session.id, "format": body.format, "sample_rate": self.sample_rate}
        await self._send(start)
        return self.session.stream(params, policy, self, stretch=self.stretch), body.text if has_initial_text else ""

    async def _receive_text(self) -> str:
        msg = await self.session.receive(self.ws.receive)
        if msg["type"] == "websocket.disconnect":
            raise Gone
        text = msg.get("text")
        if text is None:
            message = "binary frames are not accepted: send JSON text messages"
            raise SessionError(ErrorKind.UNSUPPORTED, message, "binary_frame")
        limit = self.cfg.ws.max_message_bytes
        if _utf8_longer_than(text, limit):
            raise SessionError(ErrorKind.TOO_LARGE, f"message larger than {limit} bytes", "message_too_big")
        return text

    # ------------------------------------------------------------------ the stream's sink

    async def audio(self, part: int, chunk: RequestOutput) -> None:
        if self.encoder is None:
            self.encoder = ThreadedEncoder(  # as HTTP does: encoding stays off the event loop
                self.format, self.sample_rate, self.stretch, model_rate=self.st.engine.sample_rate
            )
        # Audio that piled up while the client read slowly arrives as one delta: sent in frames of at most
        # MAX_FRAME_SAMPLES, under the 1 MiB message limit of common clients (websockets' default).
        pieces = range(0, max(len(chunk.audio), 1), MAX_FRAME_SAMPLES)
        for i, start in enumerate(pieces):
            piece = chunk.audio[start : start + MAX_FRAME_SAMPLES]
            last = chunk.finished and i == len(pieces) - 1
            before = self.encoder.samples_out
            data = await self.encoder.write(piece) + (await self.encoder.finish() if last else b"")
            await self._send_chunk(part, self.encoder.samples_out - before, chunk.elapsed_s, data)
        if self.timestamps:
            if self.clock is None:
                self.clock = SegmentClock(self.model_samples, self.sentences)
            self.model_samples += len(chunk.audio)
            for span in self.clock.feed(chunk):
                await self._send({**segment_event(span, "segment"), "part": part})

    def part_done(self) -> None:
        if self.encoder is not None:
            self.encoder.close()
            self.encoder = None
        if self.clock is not None:
            self.sentences, self.clock = self.clock.next_index, None

    async def refused(self, part: int, text: str, error: SessionError) -> None:
        await self._send(_error_event(error.message, error.code, fatal=False, part=part, text=excerpt(text)))

    async def end(self) -> None:
        end = {"type": "end", "chunks": self.chunks, "audio_seconds": self.samples / self.sample_rate}
        async with self.send_lock:
            await self._guard(self.ws.send_text(json.dumps(end)))
            await self._guard(self.ws.close())

    # ------------------------------------------------------------------ sending

    async def _send_chunk(self, part: int, samples: int, elapsed_s: float, data: bytes) -> None:
        event = {
            "type": "chunk",
            "index": self.chunks,
            "samples": samples,
            "bytes": len(data),
            "elapsed_s": round(elapsed_s, 4),
            "part": part,
        }
        self.chunks += 1
        self.samples += samples
        # Shielded: a cancelled speaker still sends the frame its event announced (the lock keeps others out).
        sending = asyncio.ensure_future(self._send_pair(event, data))
        sending.add_done_callback(_retrieve)  # if nobody awaits it any more, its Gone is not "never retrieved"
        await asyncio.shield(sending)

    async def _send_pair(self, event: dict, data: bytes) -> None:
        async with self.send_lock:
            await self._guard(self.ws.send_text(json.dumps(event)))
            if data:
                await self._guard(self.ws.send_bytes(data))

    async def _send(self, event: dict) -> None:
        async with self.send_lock:
            await self._guard(self.ws.send_text(json.dumps(event)))

    async def _guard(self, sending) -> None:
        """Awaits a send or close within ``send_timeout_s``; a client that has gone away, or stopped reading,
        becomes ``Gone`` (the session then ends, aborting its request and freeing its slot)."""
        await _timed(sending, self.cfg.timeouts.send_s)

    async def close_with(self, error: SessionError) -> None:
        async with self.send_lock:
            await _send_error(self.ws, error.message, error.code, _CLOSE_CODES[error.kind])


def _retrieve(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()


def _parse(raw: str) -> dict:
    """A later message: ``{"type": "text", "text": str}`` or ``{"type": "end"}``; anything else ends the session."""
    try:
        msg = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: absurdly nested JSON
        raise SessionError(ErrorKind.BAD_INPUT, f"bad message: not JSON: {excerpt(raw)}", "invalid_message") from None
    kind = msg.get("type") if isinstance(msg, dict) else None
    if (kind == "text" and isinstance(msg.get("text"), str)) or kind == "end":
        return msg
    raise SessionError(ErrorKind.BAD_INPUT, f"bad message: unexpected message {excerpt(raw)}", "invalid_message")


def _utf8_longer_than(text: str, limit: int) -> bool:
    # A character is 1 to 4 bytes in UTF-8: only the in-between case needs encoding.
    if len(text) > limit:
        return True
    if 4 * len(text) <= limit:
        return False
    return len(text.encode("utf-8", "surrogatepass")) > limit


def _error_event(message: str, code: str, **extra) -> dict:
    return {"type": "error", "message": excerpt(message, MAX_ERROR_CHARS), "code": code, "fatal": True, **extra}


async def _timed(sending, timeout_s: float) -> None:
    """Every WebSocket send and close has the HTTP body's deadline: a client that stops reading would otherwise
    hold its concurrency slot (and its connection) for as long as it keeps the socket open."""
    try:
        await asyncio.wait_for(sending, timeout_s)
    except asyncio.TimeoutError:  # (not the builtin TimeoutError before Python 3.11)
        logger.warning("WebSocket client read nothing for %g s; ending its session", timeout_s)
        raise Gone from None
    except (WebSocketDisconnect, RuntimeError, OSError):
        raise Gone from None


async def _send_error(ws: WebSocket, message: str, code: str, close_code: int) -> None:
    timeout_s = ws.app.state.config.timeouts.send_s
    try:
        await _timed(ws.send_text(json.dumps(_error_event(message, code))), timeout_s)
        await _timed(ws.close(code=close_code), timeout_s)
    except Gone:
        pass
