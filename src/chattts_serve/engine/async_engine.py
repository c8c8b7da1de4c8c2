"""``AsyncEngine``: the serving front end. The engine loop runs in a background thread, so the event
loop never blocks on the model; each request has one output collector.

    engine = AsyncEngine.from_pretrained("./ckpt")
    async for chunk in engine.stream("你好。", SamplingParams(seed=1)):
        play(chunk.audio)                      # float32 PCM, 24 kHz, as soon as it is decoded

Text normalisation and validation run in a worker thread before the request reaches the loop (bad
input raises ``ValueError`` in the caller). A full queue raises ``QueueFullError`` at once. If the
consumer stops early (``break``, cancellation, a disconnected client), the request is aborted and its
slot is free at the next step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import ctypes.util
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import openmp
from ..audio.policy import StreamPolicy
from ..device import bind_thread
from ..models.chattts.config import DEFAULT_MODEL
from ..sampling_params import SamplingParams
from .config import EngineConfig
from .core import EngineStats
from .engine import Engine
from .input_processor import PreparedRequest
from .outputs import RequestOutput, Result, SegmentSpan, build_result
from .scheduler import QueueFullError

logger = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """A request failed inside the engine (the engine itself keeps serving)."""


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can be served."""


class UnspeakableInput(ValueError):
    """The request's input cannot be spoken, found only once the engine ran it (a sentence's text too long for
    a slot even unrefined and in parts): the client's error, as the ValueError of a request refused up front."""


class ShutdownError(EngineError):
    """The server is stopping and ended this request before it was done (its audio is incomplete)."""


@dataclass(frozen=True, slots=True)
class _AddRequest:
    """To the engine loop: queue this prepared request (its room was reserved in ``_pending_adds``)."""

    request_id: str
    prepared: PreparedRequest
    policy: StreamPolicy
    priority: int


@dataclass(frozen=True, slots=True)
class _AbortRequest:
    """To the engine loop: stop this request."""

    request_id: str


@dataclass(frozen=True, slots=True)
class _DeviceCall:
    """To the engine loop: run ``fn`` there (device work that is not a request, such as a voice encode)
    and put its result or error into ``future``."""

    fn: Callable[[], Any]
    future: concurrent.futures.Future


@dataclass(eq=False)
class _Collector:
    """One request's outputs. The engine thread puts; one consumer takes. If the consumer is slow,
    new audio is merged into the pending list (one entry per engine step at most), so the loop never
    waits on a consumer."""

    loop: asyncio.AbstractEventLoop
    event: asyncio.Event = field(default_factory=asyncio.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    audio: list[np.ndarray] = field(default_factory=list)
    spans: list[SegmentSpan] = field(default_factory=list)
    final: RequestOutput | None = None
    error: BaseException | None = None
    pending_samples: int = 0
    """Audio put but not yet taken: what a consumer that stopped reading makes us hold."""

    def put(self, out: RequestOutput) -> None:
        with self.lock:
            if len(out.audio):
                self.audio.append(out.audio)
                self.pending_samples += len(out.audio)
            self.spans += out.spans
            if out.finished:
                self.final = out
        self._wake()

    def fail(self, error: BaseException) -> None:
        with self.lock:
            self.error = error
        self._wake()

    def _wake(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self.event.set)
        except RuntimeError:  # the consumer's event loop is closed: nobody is listening
            pass

    async def take(self) -> tuple[np.ndarray, list[SegmentSpan], RequestOutput | None, BaseException | None]:
        await self.event.wait()
        with self.lock:
            self.event.clear()
            audio = np.concatenate(self.audio) if self.audio else np.zeros(0, np.float32)
            spans, self.audio, self.spans, self.pending_samples = self.spans, [], [], 0
            return audio, spans, self.final, self.error


def _malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


_TRIM = _malloc_trim()


def release_free_memory() -> None:
    """glibc keeps freed memory of the many differently sized step tensors in its arenas (RSS grows
    with the requests served; measured in BENCHMARKS.md): give it back when the engine goes idle."""
    if _TRIM is not None:
        _TRIM(0)


class SlowConsumerError(EngineError):
    """The consumer left more audio unread than ``max_buffered_audio_s``: the request was aborted."""


class AsyncEngine:
    def __init__(self, engine: Engine, max_buffered_audio_s: float = 120.0) -> None:
        """``max_buffered_audio_s``: audio a request may hold for a consumer that stopped reading;
        beyond it the request is aborted (a stalled client pins neither memory nor a KV slot)."""
        self.engine = engine
        self.core = engine.core
        self.stream_policy = engine.config.stream
        self.max_buffered_samples = int(max_buffered_audio_s * engine.sample_rate)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._collectors: dict[str, _Collector] = {}
        self._wakeup = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pending_adds = 0
        self._in_core: set[str] = set()
        """Requests added to the core whose final output is not yet delivered (the engine thread's only)."""
        self._lock = threading.Lock()
        self.dead_error: BaseException | None = None
        # The loop thread takes every step from here: the OpenMP pool the building thread used for the load
        # goes, or libgomp counts both pools and throttles every barrier of every step (``openmp``).
        openmp.release_pool()

    @classmethod
    def from_pretrained(
        cls,
        path_or_repo: str | Path = DEFAULT_MODEL,
        device: str | torch.device = "cpu",
        config: EngineConfig | None = None,
        *,
        max_buffered_audio_s: float = 120.0,
        family: str | None = None,
    ) -> AsyncEngine:
        return cls(Engine.from_pretrained(path_or_repo, device, config, family), max_buffered_audio_s)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="chattts-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort everything in flight and stop the loop thread."""
        for rid in list(self._collectors):
            self.abort(rid)
        self._stop.set()
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def end_all(self, reason: str) -> int:
        """Fail every request in flight with ``ShutdownError(reason)`` and abort it: what a stopping
        server does with streams that outlast its grace period, so that their clients see an explicit
        end instead of a cut connection. Returns how many requests it ended."""
        ended = 0
        for rid, collector in list(self._collectors.items()):
            collector.fail(ShutdownError(reason))
            self.abort(rid)
            ended += 1
        return ended

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead_error is None

    # ------------------------------------------------------------------ requests

    def abort(self, request_id: str) -> None:
        self._inbox.put(_AbortRequest(request_id))
        self._wakeup.set()

    async def stream(
        self,
        text: str,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        policy: StreamPolicy | None = None,
        priority: int = 0,
        max_audio_seconds: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """The request's audio in deltas as it is decoded; the last one has ``finished`` set and the
        sentences' texts and codes. Raises ValueError (bad input), QueueFullError (no capacity),
        EngineError (the request failed) or EngineDeadError. ``max_audio_seconds``: this request's audio
        budget when tighter than the engine's (``InputProcessor.prepare``)."""
        params = params or SamplingParams()
        prepared = await asyncio.to_thread(self.core.prepare, text, params, max_audio_seconds)
        rid, collector, t0 = self._submit(prepared, request_id, policy or self.stream_policy, priority)
        index, position, finished, spans = 0, 0, False, []
        segment = 0  # the segment the audio to come belongs to (they are spoken, and their audio sent, in order)
        try:
            while True:
                audio, new_spans, final, error = await collector.take()
                spans += new_spans  # a sentence without audio goes out with the next delta
                if error is not None:
                    finished = True
                    raise error
                done = final is not None
                if len(audio) or done:
                    if done and final.finish_reason == "error":
                        finished = True
                        raise (UnspeakableInput if final.bad_input else EngineError)(final.error or "request failed")
                    # The last delta is the engine's final output (its sentences, usage, voice sample)
                    # carrying all the audio not yet taken; the others carry audio and the sentences they complete.
                    fields = {
                        "index": index,
                        "start_sample": position,
                        "elapsed_s": time.monotonic() - t0,
                        "spans": spans,
                        "sample_rate": self.engine.sample_rate,
                    }
                    if prepared.stretches is not None:
                        runs, segment = _stretch_runs(prepared.stretches, segment, position, audio, spans)
                        fields["stretches"] = runs
                    if done:
                        chunk = replace(final, audio=audio, **fields)
                    else:
                        chunk = RequestOutput(rid, audio, **fields)
                    index, position, spans = index + 1, position + len(audio), []
                    finished = done
                    yield chunk
                if done:
                    return
        finally:
            self._collectors.pop(rid, None)
            if not finished:
                self.abort(rid)

    async def generate(
        self, text: str, params: SamplingParams | None = None, *, request_id: str | None = None, priority: int = 0
    ) -> Result:
        """The whole utterance (decoded once at the end of each sentence, no streaming overhead)."""
        t0 = time.monotonic()
        parts, first, last = [], None, None
        async for chunk in self.stream(
            text, params, request_id=request_id, policy=StreamPolicy.one_shot(), priority=priority
        ):
            if first is None and len(chunk.audio):
                first = chunk.elapsed_s
            parts.append(chunk.audio)
            last = chunk
        audio = np.concatenate(parts) if parts else np.zeros(0, np.float32)
        return build_result(last, audio, time.monotonic() - t0, first)

    def _submit(
        self, prepared: PreparedRequest, request_id: str | None, policy: StreamPolicy, priority: int
    ) -> tuple[str, _Collector, float]:
        if self.dead_error is not None:
            raise EngineDeadError(f"engine loop stopped: {self.dead_error}")
        if self._stop.is_set():
            raise EngineDeadError("engine is shutting down")
        self.start()
        rid = request_id or f"req-{uuid.uuid4().hex[:12]}"
        with self._lock:
            if rid in self._collectors:
                raise ValueError(f"request id {rid!r} is already in use")
            if not self.core.can_accept(self._pending_adds + len(prepared.segments)):
                max_waiting = self.core.config.scheduler.max_waiting
                raise QueueFullError(f"waiting queue is full ({max_waiting} sequences)")
            collector = _Collector(asyncio.get_running_loop())
            self._collectors[rid] = collector
            self._pending_adds += len(prepared.segments)
        t0 = time.monotonic()
        self._inbox.put(_AddRequest(rid, prepared, policy, priority))
        self._wakeup.set()
        return rid, collector, t0

    # ------------------------------------------------------------------ the loop thread

    def _run(self) -> None:
        busy = False
        try:
            bind_thread(self.engine.device)  # once: this thread makes every device call of the engine
            while not self._stop.is_set():
                self._drain_inbox()
                if self.core.has_unfinished():
                    busy = True
                    self._deliver(self._step())
                else:
                    if busy:  # just went idle: hand freed heap pages back to the OS
                        busy = False
                        release_free_memory()
                    self._wakeup.wait(0.5)
                    self._wakeup.clear()
            # Shutting down: finish the aborts, tell every remaining consumer.
            self._drain_inbox()
            while self.core.has_unfinished():
                self._deliver(self._step())
            self._fail_device_calls(EngineDeadError("engine is shutting down"))
        except BaseException as exc:  # the loop must never die silently
            logger.exception("engine loop crashed")
            self.dead_error = exc
            self._fail_device_calls(EngineDeadError(f"engine loop crashed: {exc}"))
            for c in list(self._collectors.values()):
                c.fail(EngineDeadError(f"engine loop crashed: {exc}"))
        finally:
            try:
                self.core.close()  # the engine's own threads (a CPU's audio worker) end with its loop
            except Exception:
                logger.exception("closing the engine failed")

    def _step(self) -> list[RequestOutput]:
        """One engine step. An unexpected error (the core guards the model and the audio itself) fails
        every request in flight and resets the core, and the loop serves on; only an error while
        resetting ends the loop (then ``dead_error`` is set and ``/health`` fails)."""
        try:
            return self.core.step()
        except Exception:
            logger.exception("engine step failed; failing the requests in flight and resetting the engine")
            outputs = self.core.reset("engine step failed")
            # A request the failed step had already ended is no longer in the core, so the reset gives it
            # nothing: its final output was lost with the step, and without this its client waits forever.
            ended = {out.request_id for out in outputs if out.finished}
            for rid in self._in_core - ended:
                self._in_core.discard(rid)
                if (c := self._collectors.get(rid)) is not None:
                    c.fail(EngineError("engine step failed"))
            return outputs

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.finished:
                self._in_core.discard(out.request_id)
            c = self._collectors.get(out.request_id)
            if c is None:
                continue
            c.put(out)
            if not out.finished and c.pending_samples > self.max_buffered_samples:
                self.core.abort(out.request_id)
                seconds = self.max_buffered_samples / self.engine.sample_rate
                c.fail(SlowConsumerError(f"the client read no audio while {seconds:g} s waited; request aborted"))

    def _fail_device_calls(self, error: BaseException) -> None:
        """The loop is gone: fail every device call still waiting in the inbox (requests fail by collector)."""
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, _DeviceCall) and item.future.set_running_or_notify_cancel():
                item.future.set_exception(error)

    def _drain_inbox(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            match item:
                case _AbortRequest(rid):
                    self.core.abort(rid)
                case _DeviceCall(fn, future):
                    if future.set_running_or_notify_cancel():
                        try:
                            future.set_result(fn())
                        except Exception as exc:  # this call's caller gets it; the loop serves on
                            future.set_exception(exc)
                case _AddRequest(rid, prepared, policy, priority):
                    with self._lock:
                        self._pending_adds -= len(prepared.segments)
                    try:
                        self.core.add_request(rid, prepared, policy, priority)
                        self._in_core.add(rid)
                    except Exception as exc:  # queue full after all, duplicate id, too long: this request only
                        if (c := self._collectors.get(rid)) is not None:
                            c.fail(exc)
                case _:
                    raise TypeError(f"unknown engine loop message {item!r}")

    # ------------------------------------------------------------------ what the server needs

    @property
    def family(self):
        """The model's family (``models.family.ModelFamily``)."""
        return self.engine.family

    @property
    def sample_rate(self) -> int:
        return self.engine.sample_rate

    @property
    def voices(self):
        """The model's voices (``models.family.Voices``)."""
        return self.engine.voices

    @property
    def hidden_size(self) -> int:
        return self.engine.hidden_size

    @property
    def device(self):
        return self.engine.device

    @property
    def decode_mode(self) -> str:
        return self.engine.decode_mode

    @property
    def max_audio_seconds(self) -> float:
        """The most audio one request may generate (``EngineConfig.max_audio_seconds``)."""
        return self.engine.config.max_audio_seconds

    @property
    def speaker_stats(self):
        """The checkpoint's speaker statistics (None without them): voice blends mix where speakers are sampled."""
        return self.engine.speaker_stats

    def sample_speaker(self, seed: int | None = None) -> str:
        return self.engine.sample_speaker(seed)

    async def speaker_from_audio(self, wav: np.ndarray) -> str:
        """``Engine.speaker_from_audio`` on the engine loop's thread, between two steps: every device
        call of the engine is made by that one thread (a DVAE encode on another thread would allocate
        and copy while a step graph is being captured or replayed, on whatever device that thread has
        current)."""
        return await self._on_loop(lambda: self.engine.speaker_from_audio(wav))

    async def _on_loop(self, fn: Callable[[], Any]) -> Any:
        if self.dead_error is not None:
            raise EngineDeadError(f"engine loop stopped: {self.dead_error}")
        if self._stop.is_set():
            raise EngineDeadError("engine is shutting down")
        self.start()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(_DeviceCall(fn, future))
        self._wakeup.set()
        return await asyncio.wrap_future(future)

    def stats(self) -> EngineStats:
        return self.core.stats()


def _stretch_runs(
    factors: tuple[float, ...], segment: int, position: int, audio: np.ndarray, spans: list[SegmentSpan]
) -> tuple[tuple[tuple[int, float], ...], int]:
    """A delta's audio as (samples, stretch factor) runs, and the segment the next delta's audio starts in.
    ``segment``: the segment this delta's audio starts in; ``position``: its first sample in the request's
    audio; ``spans``: the sentences it completes, whose ends are its cuts (a sentence's span comes with the
    audio that ends it: ``_Collector``)."""
    runs: list[tuple[int, float]] = []
    done = 0
    for span in spans:
        end = min(max(span.end - position, done), len(audio))
        if end > done:
            runs.append((end - done, factors[min(segment, len(factors) - 1)]))
        done, segment = end, span.index + 1
    if len(audio) > done:
        runs.append((len(audio) - done, factors[min(segment, len(factors) - 1)]))
    merged: list[tuple[int, float]] = []
    for n, f in runs:  # one run per factor: the encoder switches stretcher only where the factor changes
        if merged and merged[-1][1] == f:
            merged[-1] = (merged[-1][0] + n, f)
        else:
            merged.append((n, f))
    return tuple(merged), segment
