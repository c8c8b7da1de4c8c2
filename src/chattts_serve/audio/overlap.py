"""Audio decode off the critical path: Decoder + Vocos on a CUDA stream of their own, overlapping the
next GPT step, the audio collected at a later engine step.

    step n:    GPT step n (current stream) -> hidden states pushed -> ``submit`` windows of step n
    step n+1:  GPT step n+1 runs on the current stream while the audio stream decodes step n's
               windows -> ``collect`` what is done (the engine waits only when it has nothing else to do)

Ordering and lifetimes, by construction:

* ``submit`` records an event on the current stream after the hidden states were written, and the
  audio stream waits on it: the decode reads complete rows without the host waiting for anything.
* The windows' hidden-state buffers were allocated on the current stream and are read on the audio
  stream: ``record_stream`` tells the caching allocator so, and the pending entry keeps them alive
  until its audio is collected.
* The audio reaches the host by a non-blocking copy into pinned memory on the audio stream, followed
  by an event; ``collect`` reads a batch only after that event (``query`` to poll, ``synchronize``
  to wait): never a blocking pageable ``.cpu()``.

With overlap on a CPU the audio stream is a worker thread (``ThreadStreams``): ``submit`` hands the
decode to it and returns, the engine thread runs the next step (ONNX Runtime, OpenVINO and torch kernels
release the GIL) on the other core, and the event is the worker's future. Without overlap every stream
operation is a no-op (``InlineStreams``): the work is done when submitted and collected at once, in the step
that submitted. One code path for the three: ``Streams.run`` queues the work on the audio stream (CUDA: its
kernels, launched now; threads: the call itself) and gives back its value with the event after which the
value may be read.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from ..device import current_stream, host_empty, new_stream
from ..models.chattts.checkpoint import LoadedModel
from .decode import DecodedBatch, decode_on_device
from .graphs import AudioGraphs
from .stream import AudioStream, Window

logger = logging.getLogger(__name__)


class Event(Protocol):
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...


class Queued(Protocol):
    """Work queued on a stream: an ``Event`` whose ``value`` may be read once it has happened."""

    def query(self) -> bool: ...
    def synchronize(self) -> None: ...
    def value(self) -> Any:
        """The work's return value (raises what the work raised)."""
        ...


class Streams(Protocol):
    """The stream operations the decoder uses (``torch.cuda`` on CUDA, a worker thread or no-ops on a CPU)."""

    def current(self) -> Any: ...
    def new(self) -> Any: ...
    def use(self, stream: Any) -> AbstractContextManager: ...
    def record(self, stream: Any) -> Event: ...
    def wait(self, stream: Any, event: Event) -> None: ...
    def keep(self, tensor: torch.Tensor, stream: Any) -> None: ...
    def pinned(self) -> bool: ...
    def run(self, stream: Any, work: Callable[[], Any]) -> Queued:
        """``work`` on ``stream``: its stream operations and kernels ordered on it, its value readable once
        the result has happened."""
        ...

    def close(self) -> None:
        """Let go of what ``new`` made (a worker thread: joined, after the work queued on it)."""
        ...


class _Done:
    """An event that has happened (CPU work is finished when its call returns)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


@dataclass(slots=True)
class _Launched:
    """Work whose launch returned ``result`` (CUDA: its kernels queued), to be read once ``done`` has happened."""

    result: Any
    done: Event

    def query(self) -> bool:
        return self.done.query()

    def synchronize(self) -> None:
        self.done.synchronize()

    def value(self) -> Any:
        return self.result


class _Launching:
    """``run`` where the calling thread launches the work itself: in ``stream``'s scope, an event after it."""

    def run(self, stream: Any, work: Callable[[], Any]) -> Queued:
        with self.use(stream):  # type: ignore[attr-defined]
            result = work()
            return _Launched(result, self.record(stream))  # type: ignore[attr-defined]

    def close(self) -> None:
        pass


class InlineStreams(_Launching):
    """A CPU without overlap: one implicit stream, work done in program order; every operation a no-op."""

    def current(self) -> None:
        return None

    def new(self) -> None:
        return None

    def use(self, stream: Any) -> AbstractContextManager:
        return nullcontext()

    def record(self, stream: Any) -> Event:
        return _Done()

    def wait(self, stream: Any, event: Event) -> None:
        pass

    def keep(self, tensor: torch.Tensor, stream: Any) -> None:
        pass

    def pinned(self) -> bool:
        return False


class CudaStreams(_Launching):
    """The streams of one CUDA device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def current(self) -> torch.cuda.Stream:
        return current_stream(self.device)

    def new(self) -> torch.cuda.Stream:
        return new_stream(self.device)

    def use(self, stream: torch.cuda.Stream) -> AbstractContextManager:
        return torch.cuda.stream(stream)

    def record(self, stream: torch.cuda.Stream) -> Event:
        return stream.record_event()

    def wait(self, stream: torch.cuda.Stream, event: Event) -> None:
        stream.wait_event(event)

    def keep(self, tensor: torch.Tensor, stream: torch.cuda.Stream) -> None:
        tensor.record_stream(stream)

    def pinned(self) -> bool:
        return True


class _Finished:
    """A worker's future as an event: it has happened when the call has returned (or raised)."""

    def __init__(self, future: Future) -> None:
        self.future = future

    def query(self) -> bool:
        return self.future.done()

    def synchronize(self) -> None:
        wait_for([self.future])  # its error, if any, is the value's

    def value(self) -> Any:
        return self.future.result()


class _Worker:
    """One thread of its own for the audio stream, started at its first work (again after ``close``)."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = None

    def submit(self, work: Callable[[], Any]) -> Future:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                max_workers=1,
                thread_name_prefix="chattts-audio",
                initializer=torch.set_num_threads,
                initargs=(self.threads,),
            )
        return self._pool.submit(_without_grad, work)

    def close(self) -> None:
        """Join the thread once the work queued on it is done."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


def _without_grad(work: Callable[[], Any]) -> Any:
    with torch.inference_mode():
        return work()


class ThreadStreams(InlineStreams):
    """A CPU with the audio stream on a worker thread of its own ("a CPU stream"): ``new`` makes the worker
    (one thread, started at its first work, joined by ``close``), and ``run`` on it returns at once with the
    call's future as the event. The engine thread is ``current``: work run there is done when ``run`` returns.

    Threads: torch's intra-op thread count is per calling thread under OpenMP (torch's CPU backend here:
    ``omp_set_num_threads`` sets the caller's own count; a new thread starts from the last count set anywhere),
    so the worker sets its own, ``threads`` (default: the engine thread's at construction; the engine passes the
    plan's ``audio_threads``), and the engine thread's stays as it was. ONNX Runtime and OpenVINO
    graphs run on their sessions' own pools (``audio.cpu_graph``: their thread count was fixed when they were
    built). Each call on the worker runs under ``torch.inference_mode``: grad mode and autocast are per thread,
    the engine thread's do not carry over."""

    def __init__(self, threads: int | None = None) -> None:
        self.threads = threads or torch.get_num_threads()
        self._workers: list[_Worker] = []

    def new(self) -> _Worker:
        worker = _Worker(self.threads)
        self._workers.append(worker)
        return worker

    def run(self, stream: Any, work: Callable[[], Any]) -> Queued:
        if not isinstance(stream, _Worker):  # the engine thread's own stream
            return super().run(stream, work)
        return _Finished(stream.submit(work))

    def close(self) -> None:
        for worker in self._workers:
            worker.close()


Entry = tuple[Any, Any, Window]
"""(request id, segment, window), as ``RequestPipeline.windows`` gives them."""


@dataclass(slots=True)
class _Pending:
    entries: list[Entry]
    done: Queued
    """Its value: (the ``DecodedBatch``es, per batch its audio on the host or None), once it has happened."""


class AudioDecoder:
    """Submits windows for decoding and hands their audio back, in submission order."""

    def __init__(
        self,
        model: LoadedModel,
        device: torch.device,
        dtype: str,
        overlap: bool,
        buckets: bool,
        streams: Streams | None = None,
        max_in_flight: int = 2,
        threads: int | None = None,
    ) -> None:
        """``dtype``: resolved (``engine.plan.ExecutionPlan.audio_dtype``). ``overlap``: collect at a later step
        (the decode runs on its own stream: CUDA's, or a CPU's worker thread). ``buckets``: pad windows to fixed
        lengths. ``max_in_flight``: submissions not yet collected before the decoder is ``full``. ``threads``: a CPU
        worker's torch threads (``ExecutionPlan.audio_threads``; default the engine thread's)."""
        self.model, self.dtype, self.overlap, self.buckets = model, dtype, overlap, buckets
        self.device = device
        if streams is None:
            cuda = device.type == "cuda"
            streams = CudaStreams(device) if cuda else ThreadStreams(threads) if overlap else InlineStreams()
        self.streams = streams
        self.stream = self.streams.new() if overlap else self.streams.current()
        self.max_in_flight = max(1, max_in_flight)
        self.graphs: AudioGraphs | None = None
        """Decoder + Vocos graphs per window bucket, captured on ``stream`` (``audio.graphs``; CUDA)."""
        self._pending: deque[_Pending] = deque()
        self._busy: set[int] = set()  # id() of the AudioStreams with a window in flight

    def busy(self, stream: AudioStream) -> bool:
        """Whether a window of ``stream`` is in flight (its next window is not known before it is in)."""
        return id(stream) in self._busy

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    @property
    def full(self) -> bool:
        """``max_in_flight`` submissions are not collected yet: ``submit`` refuses more (the caller keeps its
        windows for a later step instead of the host waiting for the oldest)."""
        return len(self._pending) >= self.max_in_flight

    def submit(
        self, entries: list[Entry], beside: bool = True
    ) -> list[tuple[list[Entry], list[np.ndarray | Exception]]]:
        """Queue the decode of ``entries`` (none of whose streams may be ``busy``; not while ``full``).
        Returns nothing: the audio comes from ``collect`` (kept as a list for callers that add to it).
        ``beside=False`` (overlap on a CPU, after a step that used every core): decode on the engine thread now,
        after what is in flight, and return every submission's audio, this one's last."""
        if any(self.busy(w.stream) for _, _, w in entries):
            raise ValueError("a window of this stream is already being decoded")
        if entries and self.full:
            raise RuntimeError(f"{self.in_flight} audio submissions in flight: collect one first")
        out: list[tuple[list[Entry], list[np.ndarray | Exception]]] = []
        if not entries:
            return out
        s, stream = self.streams, self.stream
        inline = self.overlap and not beside and isinstance(s, ThreadStreams)
        if inline:  # the worker's submissions first: in order, and not two decodes on the cores at once
            out += self.collect(wait=True)
            stream = s.current()
        ready = s.record(s.current())  # after this step's hidden states were written
        windows = [w for _, _, w in entries]

        def work() -> tuple[list[DecodedBatch], list[torch.Tensor | None]]:
            # On a worker thread this reads the streams' hidden-state rows while the engine thread writes the
            # next step's: other rows, or later steps of these (a stream has one window in flight at most).
            s.wait(stream, ready)
            for w in windows:
                s.keep(w.stream.hidden, stream)
            batches = decode_on_device(self.model, windows, self.dtype, buckets=self.buckets, graphs=self.graphs)
            host = [self._to_host(b.wav) if b.wav is not None else None for b in batches]
            for b in batches:
                b.wav = None  # on the audio stream's pool: reused only by its later work, after the copy
            return batches, host

        if inline:
            try:
                queued = s.run(stream, work)  # done when it returns
            except Exception as exc:  # as on the worker: this submission fails, what was collected stands
                logger.exception("audio decode failed")
                return [*out, (entries, [exc] * len(entries))]
            return [*out, self._take(_Pending(entries, queued), waited=True)]
        self._pending.append(_Pending(entries, s.run(stream, work)))
        self._busy.update(id(w.stream) for w in windows)
        return out

    def collect(self, wait: bool) -> list[tuple[list[Entry], list[np.ndarray | Exception]]]:
        """The audio of every submission that is done, oldest first, as (entries, audio or error
        per entry); ``wait``: wait for all of them."""
        out = []
        while self._pending:
            done = self._pending[0].done.query()
            if not (wait or done):
                break
            out.append(self._take(self._pending.popleft(), waited=done))
        return out

    def drop(self) -> None:
        """Forget every submission (after waiting for it: its buffers must outlive the kernels)."""
        while self._pending:
            self._pending.popleft().done.synchronize()
        self._busy.clear()

    def close(self) -> None:
        """``drop``, then let go of the audio stream (a CPU's worker thread: joined; a later ``submit`` starts
        another)."""
        self.drop()
        self.streams.close()

    def _to_host(self, wav: torch.Tensor) -> torch.Tensor:
        if not self.streams.pinned():
            return wav.cpu()
        host = host_empty(tuple(wav.shape), wav.dtype, self.device)
        host.copy_(wav, non_blocking=True)
        return host

    def _take(self, p: _Pending, waited: bool = False) -> tuple[list[Entry], list[np.ndarray | Exception]]:
        """``waited``: its event has happened (``query``): no wait to make."""
        self._busy.difference_update(id(w.stream) for _, _, w in p.entries)
        audio: list[np.ndarray | Exception | None] = [None] * len(p.entries)
        try:
            if not waited:
                p.done.synchronize()
            batches, hosts = p.done.value()
        except Exception as exc:  # an asynchronous device error, or the worker's: fail the whole submission
            logger.exception("audio decode failed")
            return p.entries, [exc] * len(p.entries)
        pinned = self.streams.pinned()
        for batch, host in zip(batches, hosts, strict=True):
            wav = host.numpy() if host is not None else None
            for row, (i, n) in enumerate(zip(batch.index, batch.samples, strict=True)):
                if wav is None:
                    audio[i] = batch.error
                else:
                    # Out of the pinned block (a request keeps its audio; pinned memory is scarce).
                    audio[i] = wav[row, :n].copy() if pinned else wav[row, :n]
        return p.entries, audio  # type: ignore[return-value]


def split_failed(
    entries: Sequence[Entry], audio: Sequence[np.ndarray | Exception]
) -> tuple[dict[str, Exception], list[int]]:
    """(request id -> the error of its first failed window, indices of the windows of other requests)."""
    failed: dict[str, Exception] = {}
    for (rid, _, _), a in zip(entries, audio, strict=True):
        if isinstance(a, Exception):
            failed.setdefault(rid, a)
    return failed, [i for i, (rid, _, _) in enumerate(entries) if rid not in failed]
