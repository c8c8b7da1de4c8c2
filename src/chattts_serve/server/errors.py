"""How a request fails: the OpenAI-shaped ``APIError`` and its common cases (too long, busy, storage), and
how a streamed response that already started ends (``TimedStreamingResponse``, ``ResponseCut``).

``app.py``'s handlers answer them in the one JSON error shape; the WebSocket and Wyoming servers send
them as their own error events.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import HTTPException
from fastapi.responses import StreamingResponse

from .voices import VoiceStoreError

logger = logging.getLogger(__name__)


class APIError(HTTPException):
    """An error answered in the OpenAI error shape, with optional headers (Retry-After)."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(status_code=status, detail=message, headers=headers)
        self.type, self.param, self.code = type_, param, code


class StreamFailed(APIError):
    """A request failed after it started (engine error, engine stopped). Raised by
    ``AudioResponse.chunks``: before the first byte it is a 500 JSON answer; after it, each transport
    ends the response as an error (aborted body, SSE or WebSocket error event), never as success.
    The message names the request, not the internal exception (that goes to the log)."""

    def __init__(self, request_id: str) -> None:
        super().__init__(
            500,
            f"synthesis failed (request {request_id}); the server log has the cause",
            "server_error",
            code="synthesis_failed",
        )


class StreamEndedByShutdown(StreamFailed):
    """The server is stopping and its grace period ran out before this request was done."""

    def __init__(self, request_id: str) -> None:
        APIError.__init__(
            self,
            503,
            f"the server is shutting down; request {request_id} ended before its audio was complete",
            "server_error",
            code="server_shutdown",
            headers={"Retry-After": "1"},
        )


class InputRefusedMidway(StreamFailed):
    """The engine found, after the response started, that the request's own text cannot be spoken (a
    sentence too long for a slot even unrefined and in parts: ``engine.async_engine.UnspeakableInput``). The
    client's error: each transport ends the response with it as a 400-class error event, not a 500."""

    def __init__(self, message: str) -> None:
        APIError.__init__(self, 400, message, code="input_too_long")


class ClientGone(Exception):
    """The client disconnected before the response started."""


class TimedStreamingResponse(StreamingResponse):
    """A streamed body whose every send must complete within ``send_timeout_s``: a client that stops
    reading is cut off (its request is aborted as the body generator closes) instead of holding a
    concurrency slot and the engine's buffered audio forever."""

    def __init__(self, content, send_timeout_s: float, **kw) -> None:
        super().__init__(content, **kw)
        self.send_timeout_s = send_timeout_s

    async def stream_response(self, send) -> None:
        async def timed_send(message) -> None:
            try:
                await asyncio.wait_for(send(message), self.send_timeout_s)
            except asyncio.TimeoutError:  # (not the builtin TimeoutError before Python 3.11)
                logger.warning("client read nothing for %g s; closing the response", self.send_timeout_s)
                raise ClientTooSlow() from None

        try:
            await super().stream_response(timed_send)
        except StreamFailed as exc:  # the status line is out: the body ends unfinished (see ResponseCut)
            raise ResponseCut(str(exc.detail)) from None
        finally:
            await self.body_iterator.aclose()


class ResponseCut(Exception):
    """A streamed response failed after it started. The request middleware returns without finishing the
    response, so uvicorn closes the connection before the body's terminating chunk: the client sees an
    incomplete body, never a complete (truncated) file, and the log gets one line, not a traceback."""


class ClientTooSlow(OSError):
    """A send timed out (an OSError, which Starlette turns into a client disconnect)."""


def storage_error(exc: VoiceStoreError) -> APIError:
    """A voice store failure as an API error (the cause goes to the log, not to the client)."""
    logger.error("voices database: %s (%s)", exc, exc.__cause__)
    if exc.kind == "busy":  # another writer holds the file: transient, so tell clients when to retry
        return APIError(
            503,
            "the voices database is busy; retry shortly",
            "server_error",
            code="storage_busy",
            headers={"Retry-After": "1"},
        )
    if exc.kind == "full":  # 507 Insufficient Storage: the server, not the request, is out of space
        return APIError(507, "the server has no space left to store voices", "server_error", code="storage_full")
    return APIError(
        500, "the voices database failed; the server log has the cause", "server_error", code="storage_error"
    )


def check_length(text: str, limit: int, param: str) -> None:
    if len(text) > limit:
        raise APIError(
            400, f"{param} has {len(text)} characters; the limit is {limit}", param=param, code="input_too_long"
        )


def busy(message: str, status: int = 429) -> APIError:
    return APIError(
        status,
        message,
        "rate_limit_error" if status == 429 else "server_error",
        code="capacity",
        headers={"Retry-After": "1"},
    )
