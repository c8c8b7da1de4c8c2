"""Read deadlines against slow clients (slowloris): a connection must finish its request headers within
``header_timeout_s`` of opening (or of its previous response), and its body within ``body_timeout_s``.

uvicorn has neither: its keep-alive timer stops at the first byte, so a client that sends one header
byte every few seconds holds a connection (and with it one of ``limit_concurrency``'s places) forever.
The header deadline lives in the HTTP protocol (the ASGI app only sees a request once its headers are
in) and runs only while the connection waits for headers (never while a request, pipelined or not, is
served); the body deadline in an ASGI middleware that also enforces the body-size limit.
"""

from __future__ import annotations

import asyncio

from .openapi import error_response

try:  # uvicorn[standard] brings httptools; the pure-Python h11 protocol is uvicorn's fallback
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _BaseProtocol
except ImportError:  # pragma: no cover - depends on the install
    from uvicorn.protocols.http.h11_impl import H11Protocol as _BaseProtocol

_CLOSE = {"Connection": "close"}


def protocol_with_header_timeout(seconds: float) -> type:
    """uvicorn's HTTP protocol class (``uvicorn.Config(http=...)``) with a header deadline."""

    class HeaderDeadlineProtocol(_BaseProtocol):
        header_timeout_s = seconds

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._header_timer: asyncio.TimerHandle | None = None
            self._timed_cycle = None
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.transport.get_protocol() is not self:  # upgraded to a WebSocket: its own rules apply
                self._disarm()
            elif self.cycle is not None and self.cycle is not self._timed_cycle:  # headers complete
                self._timed_cycle = self.cycle
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            # Keep-alive: the next request's headers get a deadline, unless they are in already (pipelined:
            # the base class has just started that request, and ``cycle`` is it). Arming here regardless
            # cut a pipelined request's stream at the deadline.
            waiting = self.cycle is None or self.cycle.response_complete
            if waiting and not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.close()  # nothing to answer: there is no complete request

    return HeaderDeadlineProtocol


class BodyReader:
    """ASGI middleware: reads each HTTP request body whole before the app runs, then replays it. A body
    that grows past ``max_bytes`` is a 413 (one that announces a larger Content-Length was refused by
    ``app.RequestContext`` before it got here); a body not complete within ``timeout_s`` is a 408 and the
    connection is closed. Bodies are small (JSON, or a voice upload under ``max_bytes``), so buffering
    them costs little and gives one deadline for the whole body instead of one per chunk that a trickle
    would keep resetting."""

    def __init__(self, app, max_bytes: int, timeout_s: float) -> None:
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            first = await asyncio.wait_for(self._read(receive), self.timeout_s)
        except asyncio.TimeoutError:  # (not the builtin TimeoutError before Python 3.11)
            message = f"request body not received within {self.timeout_s:g} s"
            response = error_response(408, message, code="body_timeout", headers=_CLOSE)
            return await response(scope, receive, send)
        if first is None:
            message = f"request body larger than {self.max_bytes} bytes"
            response = error_response(413, message, code="too_large", headers=_CLOSE)
            return await response(scope, receive, send)
        return await self.app(scope, _replay(first, receive), send)

    async def _read(self, receive) -> dict | None:
        """The message the app gets first: the whole body, or the disconnect that cut it short; None
        when the body passes ``max_bytes``."""
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return message
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                return None
            if not message.get("more_body", False):
                return {"type": "http.request", "body": bytes(body), "more_body": False}


def _replay(first: dict, receive):
    """A ``receive`` that returns ``first`` once, then the connection's own messages (disconnects)."""
    pending = [first]

    async def replay():
        return pending.pop() if pending else await receive()

    return replay
