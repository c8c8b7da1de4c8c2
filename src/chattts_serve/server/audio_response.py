"""``AudioResponse``: one synthesis request from submission to its last encoded byte, with its metrics.

The routes (HTTP, WebSocket, Wyoming) build the request's text, ``SamplingParams`` and ``StreamPolicy``;
this starts it on the engine, waits for the first chunk (so capacity problems are still proper status
codes), then streams PCM or encoded bytes and translates engine failures into ``errors``. A deterministic
HTTP request is looked up in the result cache first (``server.cache``): a hit replays the stored chunks
instead of running the engine, a miss that runs to its end is stored.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from typing import IO

import numpy as np
from fastapi import Request

from ..audio.encode import StreamingEncoder
from ..audio.policy import StreamPolicy
from ..audio.stretch import StreamingStretcher
from ..engine.async_engine import AsyncEngine, EngineDeadError, EngineError, ShutdownError, UnspeakableInput
from ..engine.input_processor import AudioBudgetExceeded
from ..engine.outputs import RequestOutput
from ..engine.scheduler import QueueFullError
from ..sampling_params import SamplingParams
from ..text.bound import TextTooLong
from .cache import CACHE_HEADER, ResultCache
from .errors import (
    APIError,
    ClientGone,
    InputRefusedMidway,
    StreamEndedByShutdown,
    StreamFailed,
    TimedStreamingResponse,
    busy,
)
from .limits import Limits
from .metrics import Metrics
from .params import tenant_of

logger = logging.getLogger(__name__)
_COMPLETE = ("stop", "length")
"""The finish reasons of a request that ran to its end."""
SPOOL_BYTES = 4 << 20
"""A non-streamed answer's bytes kept in memory; past this they wait in a temporary file (``spooled``), so a
few long answers at once cost disk, not the host's memory."""
_READ_BYTES = 3 << 18
"""A spooled answer leaves in blocks of this size (a multiple of 3: base64 blocks join without padding)."""
EMPTY_AUDIO_HEADER = "X-Audio-Empty"
"""``1`` on a response whose request finished without any audio: the body is then the format's shortest
silence (``audio.encode``), a file its decoder opens, rather than something that merely looks short."""


class AudioResponse:
    """Starts a request on the engine and waits for its first chunk before the HTTP response begins,
    so capacity problems and request errors are still proper status codes. Then streams the rest."""

    def __init__(
        self, engine: AsyncEngine, metrics: Metrics, limits: Limits, endpoint: str, max_queue_wait_s: float
    ) -> None:
        self.engine, self.metrics, self.limits = engine, metrics, limits
        self.endpoint, self.max_queue_wait_s = endpoint, max_queue_wait_s
        self.t0 = time.monotonic()
        self._stream: AsyncIterator[RequestOutput] | None = None
        self._first: RequestOutput | None = None
        self._status = "error"
        self.request_id = ""
        self.final: RequestOutput | None = None
        """The last output once the request has finished (usage: text tokens, audio tokens)."""
        self._audio_samples = 0
        self._metrics_done = False
        self.cache_status: str | None = None
        """``hit`` or ``miss`` once the result cache has looked the request up; None: not cacheable."""
        self._cache: ResultCache | None = None
        self._cache_key: str | None = None
        self._recorded: list[RequestOutput] | None = None
        """A miss's outputs so far, to store once it completes; None: nothing to store."""
        self._recorded_bytes = 0

    async def start(
        self,
        text: str,
        params: SamplingParams,
        policy: StreamPolicy,
        request_id: str,
        request: Request | None = None,
        max_audio_seconds: float | None = None,
    ) -> None:
        """Submit and wait for the first chunk (at most ``max_queue_wait_s``; a client that disconnects
        meanwhile aborts the request at once). With ``request`` (an HTTP route's: it names the app's result
        cache and the tenant) a deterministic request is looked up first, and a hit never reaches the engine.
        ``max_audio_seconds``: the request's audio budget when tighter than the engine's (``server.budget``)."""
        budget = {} if max_audio_seconds is None else {"max_audio_seconds": max_audio_seconds}

        def outputs() -> AsyncIterator[RequestOutput]:
            cached = self._look_up(text, params, policy, request, max_audio_seconds)
            if cached is None:
                return self.engine.stream(text, params, request_id=request_id, policy=policy, **budget)
            self._first = _replayed(cached[0], request_id, self.t0)
            return _replay(cached[1:], request_id, self.t0)

        await self.start_outputs(outputs, request_id, request)

    async def start_outputs(
        self, outputs: Callable[[], AsyncIterator[RequestOutput]], request_id: str, request: Request | None = None
    ) -> None:
        """``start`` for outputs that are not one engine request's (``server.dialogue``: several requests'
        outputs, in order): ``outputs()`` opens them once the request holds its place in the limits."""
        try:
            self.limits.acquire()
        except APIError:
            self._metrics_done = True  # nothing acquired, nothing to release
            self.metrics.rejected.labels("concurrency").inc()
            self.metrics.requests.labels(self.endpoint, "rejected").inc()
            raise
        self.metrics.in_flight.inc()
        self.request_id = request_id
        try:
            self._stream = outputs()
            if self._first is None:  # a cache hit has it already
                self._first = await self._first_chunk(request)
        except BaseException as exc:
            await self._close()
            if isinstance(exc, (QueueFullError, TimeoutError)):
                self._finish_metrics("rejected")
            else:  # cancelled: the caller went away while the request was queued (a Wyoming client did)
                self._finish_metrics("aborted" if isinstance(exc, (ClientGone, asyncio.CancelledError)) else "error")
            raise self._translate(exc) from None

    def _look_up(
        self, text: str, params: SamplingParams, policy: StreamPolicy, request: Request | None, budget: float | None
    ) -> Sequence[RequestOutput] | None:
        """The cached outputs of this request, or None (then a cacheable miss is recorded)."""
        cache = getattr(request.app.state, "cache", None) if request is not None else None
        key = cache.key(text, params, policy, tenant_of(request.scope), budget) if cache is not None else None
        if key is None:
            return None
        cached = cache.get(key)
        self.cache_status = "hit" if cached is not None else "miss"
        (self.metrics.cache_hits if cached is not None else self.metrics.cache_misses).inc()
        if cached is None:
            self._cache, self._cache_key, self._recorded = cache, key, []
        return cached

    def _record(self, chunk: RequestOutput) -> None:
        """Keep a miss's chunk; store them all once the last one shows that the request completed."""
        self._recorded.append(chunk)
        self._recorded_bytes += chunk.audio.nbytes
        if self._recorded_bytes > self._cache.max_entry_bytes:
            self._recorded = None  # too long to keep: stop holding its audio
        elif chunk.finished:
            if chunk.finish_reason in _COMPLETE:
                self._cache.put(self._cache_key, self._recorded)
                self.metrics.cache_bytes.set(self._cache.nbytes)
            self._recorded = None

    async def _first_chunk(self, request: Request | None) -> RequestOutput:
        first = asyncio.ensure_future(anext(self._stream))
        deadline = asyncio.get_running_loop().time() + self.max_queue_wait_s
        try:
            while True:
                done, _ = await asyncio.wait({first}, timeout=0.25)
                if done:
                    return first.result()
                if request is not None and await request.is_disconnected():
                    raise ClientGone()
                if asyncio.get_running_loop().time() > deadline:
                    raise TimeoutError()
        finally:
            if not first.done():
                first.cancel()  # the generator's cleanup aborts the engine request
                with contextlib.suppress(BaseException):  # let it finish before the stream is closed
                    await first

    @property
    def audio_empty(self) -> bool:
        """The request finished without any audio: known once the first chunk is the last one (a code pass
        that ended at step 0), or once every chunk has been read."""
        if self.final is not None:
            return self._audio_samples == 0
        first = self._first
        return first is not None and first.finished and first.finish_reason in _COMPLETE and not len(first.audio)

    @property
    def headers(self) -> dict[str, str]:
        """The response headers known before the body: ``EMPTY_AUDIO_HEADER`` when the audio is empty,
        ``CACHE_HEADER`` when the result cache looked the request up."""
        headers = {EMPTY_AUDIO_HEADER: "1"} if self.audio_empty else {}
        if self.cache_status is not None:
            headers[CACHE_HEADER] = self.cache_status
        return headers

    def _translate(self, exc: BaseException) -> BaseException:
        if isinstance(exc, ClientGone):  # nobody reads this answer; it only ends the request cleanly
            return APIError(499, "client closed the request", code="client_closed")
        if isinstance(exc, (TextTooLong, UnspeakableInput)):  # max_input_chars passed by an expansion (text.bound),
            return APIError(400, str(exc), code="input_too_long")  # or a sentence too long for a slot
        if isinstance(exc, AudioBudgetExceeded):  # its minimum audio passes its budget (server.budget)
            return APIError(400, str(exc), code="audio_limit")
        if isinstance(exc, ValueError):
            return APIError(400, str(exc))
        if isinstance(exc, QueueFullError):
            self.metrics.rejected.labels("queue_full").inc()
            return busy(str(exc))
        if isinstance(exc, TimeoutError):
            self.metrics.rejected.labels("queue_wait").inc()
            return busy(f"no capacity within {self.max_queue_wait_s:g} s; retry later", status=503)
        if isinstance(exc, EngineDeadError):
            logger.error("request %s: engine unavailable: %s", self.request_id, exc)
            return APIError(
                503, "the engine has stopped; retry on another replica", "server_error", code="engine_unavailable"
            )
        if isinstance(exc, ShutdownError):
            return StreamEndedByShutdown(self.request_id)
        if isinstance(exc, EngineError):
            logger.error("request %s failed: %s", self.request_id, exc)
            return StreamFailed(self.request_id)
        return exc

    async def chunks(self) -> AsyncIterator[RequestOutput]:
        """The chunks (the first one already fetched). Closing this early aborts the request."""
        try:
            chunk = self._first
            while chunk is not None:
                if len(chunk.audio) and self._audio_samples == 0:
                    self.metrics.ttfb.labels(self.endpoint).observe(time.monotonic() - self.t0)
                self._audio_samples += len(chunk.audio)
                if self._recorded is not None:
                    self._record(chunk)
                yield chunk
                if chunk.finished:
                    self._status = chunk.finish_reason or "stop"
                    self.final = chunk
                    break
                chunk = await anext(self._stream)
        except (asyncio.CancelledError, GeneratorExit):  # the client went away, or stopped reading
            self._status = "aborted"
            raise
        except UnspeakableInput as exc:  # the client's text, found too long once running: not an engine error
            self._status = "error"
            raise InputRefusedMidway(str(exc)) from None
        except ShutdownError:
            logger.warning("request %s ended by the shutdown before it was done", self.request_id)
            self._status = "error"
            raise StreamEndedByShutdown(self.request_id) from None
        except (EngineError, EngineDeadError) as exc:
            logger.error("request %s failed mid-stream: %s", self.request_id, exc)
            self._status = "error"
            raise StreamFailed(self.request_id) from None
        finally:
            await self._close()
            self._finish_metrics(self._status)

    async def encoded(
        self,
        fmt: str,
        sample_rate: int | None = None,
        on_chunk: Callable[[RequestOutput], object] | None = None,
        stretch: float = 1.0,
    ) -> AsyncIterator[bytes]:
        """The response body in ``fmt`` at ``sample_rate`` (None: the format's default), time-stretched by
        ``stretch`` (``audio.stretch``), encoded (and resampled) in a worker thread, never on the event loop.
        ``on_chunk`` sees each chunk first (its sentence spans)."""
        encoder = ThreadedEncoder(fmt, sample_rate, stretch, model_rate=self.engine.sample_rate)
        try:
            async for chunk in self.chunks():
                if on_chunk is not None:
                    on_chunk(chunk)
                data = await encoder.write(chunk.audio, chunk.stretches)
                if chunk.finished:
                    data += await encoder.finish()
                if data:
                    yield data
        finally:
            encoder.close()

    async def spool(
        self,
        fmt: str,
        sample_rate: int | None,
        request: Request,
        stretch: float = 1.0,
        on_chunk: Callable[[RequestOutput], object] | None = None,
    ) -> tuple[IO[bytes], int]:
        """The whole answer as one file (``"stream": false``), encoded as its audio arrives (as ``encoded``)
        into a ``SPOOL_BYTES`` spooled temporary file: the server never holds a long answer's samples, nor the
        copies a whole-array stretch, resample and encode would make. Returns the file, at its start, and its
        size; a wav gets its exact sizes, as ``audio.encode.encode_whole`` writes them. A client that leaves
        meanwhile ends the request."""
        spool = tempfile.SpooledTemporaryFile(SPOOL_BYTES)  # noqa: SIM115 - the caller's, or closed below
        try:
            async with contextlib.aclosing(self.encoded(fmt, sample_rate, on_chunk, stretch)) as body:
                async for data in body:
                    spool.write(data)  # (into memory, or the page cache once rolled over: no wait worth a thread)
                    if await request.is_disconnected():  # nobody waits for the whole file: stop generating it
                        raise ClientGone()
            size = spool.tell()
            if fmt == "wav":  # the streamed header's open-ended sizes -> the exact ones
                spool.seek(4)
                spool.write(struct.pack("<I", size - 8))
                spool.seek(40)
                spool.write(struct.pack("<I", size - 44))
            spool.seek(0)
            return spool, size
        except BaseException:
            spool.close()
            raise

    async def spooled(
        self, fmt: str, sample_rate: int | None, request: Request, stretch: float = 1.0, media_type: str = ""
    ) -> TimedStreamingResponse:
        """``spool``'s file as the response, with its ``Content-Length``, once complete (a failure before
        then is still a status code)."""
        spool, size = await self.spool(fmt, sample_rate, request, stretch)
        headers = {**self.headers, "Content-Length": str(size)}
        send_s = request.app.state.config.timeouts.send_s
        return TimedStreamingResponse(read_spool(spool), send_s, media_type=media_type, headers=headers)

    @property
    def samples(self) -> int:
        """The model's samples delivered so far (before any stretch)."""
        return self._audio_samples

    async def _close(self) -> None:
        if self._stream is not None:
            stream, self._stream = self._stream, None
            await stream.aclose()  # aborts the request in the engine if it is still running

    def _finish_metrics(self, status: str) -> None:
        if self._metrics_done:
            return
        self._metrics_done = True
        self.limits.release()
        self.metrics.in_flight.dec()
        self.metrics.requests.labels(self.endpoint, status).inc()
        if status == "aborted":
            self.metrics.aborted.inc()
        elif status in _COMPLETE and not self._audio_samples:
            self.metrics.empty_audio.labels(self.endpoint).inc()
        elapsed = time.monotonic() - self.t0
        self.metrics.latency.labels(self.endpoint).observe(elapsed)
        if self._audio_samples and self.cache_status != "hit":  # a hit made no audio: it says nothing of the engine
            audio_s = self._audio_samples / self.engine.sample_rate
            self.metrics.audio_seconds.inc(audio_s)
            self.metrics.rtf.observe(elapsed / audio_s)


async def read_spool(spool: IO[bytes], block: int = _READ_BYTES) -> AsyncIterator[bytes]:
    """A spooled answer's bytes in blocks of ``block``, read in a worker thread (it may be on disk); the file
    is gone after."""
    try:
        while data := await asyncio.to_thread(spool.read, block):
            yield data
    finally:
        spool.close()


def _replayed(out: RequestOutput, request_id: str, t0: float) -> RequestOutput:
    """A cached output as this request's (its id, its clock); the audio is shared, read-only."""
    return replace(out, request_id=request_id, elapsed_s=time.monotonic() - t0)


async def _replay(outputs: Sequence[RequestOutput], request_id: str, t0: float) -> AsyncIterator[RequestOutput]:
    """A cache hit's outputs after the first, in the live request's chunks."""
    for out in outputs:
        yield _replayed(out, request_id, t0)


class ThreadedEncoder:
    """A ``StreamingEncoder`` whose work runs in a worker thread: a 5 s mp3 or opus frame takes a few hundred ms
    to encode, which on the event loop would stall every other client of the server. With ``stretch`` other
    than 1, a ``StreamingStretcher`` (one per response, so its joins are seamless) comes before the encoder.

    Audio written with runs of factors of its own (``RequestOutput.stretches``: SSML rates, speed_mode
    "stretch") gets each run's: where the factor changes, the stretcher in use is flushed (its output is then
    exactly its input / its factor, nothing lost) and one with the new factor takes over; audio without runs
    gets the response's ``stretch``."""

    def __init__(self, fmt: str, sample_rate: int | None = None, stretch: float = 1.0, *, model_rate: int) -> None:
        """``model_rate``: the rate of the PCM written (the model's)."""
        self._encoder = StreamingEncoder(fmt, sample_rate, model_rate=model_rate)
        self._stretch, self._model_rate = stretch, model_rate
        self._factor = stretch
        self._stretcher = StreamingStretcher(stretch, model_rate) if stretch != 1.0 else None
        self._work: asyncio.Future | None = None

    @property
    def sample_rate(self) -> int:
        """The output's rate."""
        return self._encoder.sample_rate

    @property
    def samples_out(self) -> int:
        """Samples encoded so far, at ``sample_rate`` (read between writes)."""
        return self._encoder.samples_out

    async def write(self, pcm: np.ndarray, stretches: Sequence[tuple[int, float]] | None = None) -> bytes:
        """The bytes ready after encoding ``pcm`` (maybe none); ``stretches``: its (samples, factor) runs."""
        if stretches is None and self._factor == self._stretch:  # (always so without runs: as before them)
            return await self._in_thread(self._write, pcm)
        if stretches is None:
            stretches = ((len(pcm), self._stretch),)
        return await self._in_thread(self._write_runs, pcm, stretches)

    async def finish(self) -> bytes:
        """The bytes that complete the file; ``close`` then has nothing left to free."""
        return await self._in_thread(self._finish)

    def _write_runs(self, pcm: np.ndarray, stretches: Sequence[tuple[int, float]]) -> bytes:
        out, at = [], 0
        for n, factor in stretches:
            if factor != self._factor:
                out.append(self._switch(factor))
            out.append(self._write(pcm[at : at + n]))
            at += n
        if at < len(pcm):  # (runs that fall short: the rest at the response's factor)
            out.append(self._switch(self._stretch) if self._factor != self._stretch else b"")
            out.append(self._write(pcm[at:]))
        return b"".join(out)

    def _switch(self, factor: float) -> bytes:
        """Flush the stretcher in use and take one with ``factor``; the bytes the flush completes."""
        tail = self._encoder.write(self._stretcher.flush()) if self._stretcher is not None else b""
        self._factor = factor
        self._stretcher = StreamingStretcher(factor, self._model_rate) if factor != 1.0 else None
        return tail

    def _write(self, pcm: np.ndarray) -> bytes:
        return self._encoder.write(self._stretcher.process(pcm) if self._stretcher is not None else pcm)

    def _finish(self) -> bytes:
        tail = self._encoder.write(self._stretcher.flush()) if self._stretcher is not None else b""
        return tail + self._encoder.finish()

    async def _in_thread(self, fn, *args) -> bytes:
        self._work = asyncio.ensure_future(asyncio.to_thread(fn, *args))
        return await asyncio.shield(self._work)

    def close(self) -> None:
        """Frees the codec without finishing the file (the client left, the request failed); nothing after
        ``finish``. A worker thread keeps running when its awaiter is cancelled: the codec is freed only once
        the thread is done with it (freeing it under the thread crashes in native code)."""
        work = self._work
        if work is not None and not work.done():
            work.add_done_callback(lambda f: (f.cancelled() or f.exception(), self._encoder.close()))
        else:
            self._encoder.close()
