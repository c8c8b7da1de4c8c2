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

On a CPU every stream operation is a no-op (``InlineStreams``): the work is done when submitted, and the
same code runs (the tests drive it). ``overlap`` off (the CPU default) collects at once, in the step
that submitted: today's behaviour.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from ..device import current_stream, host_empty, new_stream
from ..models.chattts.checkpoint import LoadedModel
from .decode import DecodedBatch, decode_on_device
from .stream import AudioStream, Window

logger = logging.getLogger(__name__)


class Event(Protocol):
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...


class Streams(Protocol):
    """The stream operations the decoder uses (``torch.cuda`` on CUDA, no-ops on a CPU)."""

    def current(self) -> Any: ...
    def new(self) -> Any: ...
    def use(self, stream: Any) -> AbstractContextManager: ...
    def record(self, stream: Any) -> Event: ...
    def wait(self, stream: Any, event: Event) -> None: ...
    def keep(self, tensor: torch.Tensor, stream: Any) -> None: ...
    def pinned(self) -> bool: ...


class _Done:
    """An event that has happened (CPU work is finished when its call returns)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class InlineStreams:
    """A CPU: one implicit stream, work done in program order; every operation a no-op."""

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


class CudaStreams:
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


Entry = tuple[Any, Any, Window]
"""(request id, segment, window), as ``RequestPipeline.windows`` gives them."""


@dataclass(slots=True)
class _Pending:
    entries: list[Entry]
    batches: list[DecodedBatch]
    host: list[torch.Tensor | None]  # per batch: its audio on the host, complete once ``done`` has happened
    done: Event


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
    ) -> None:
        """``dtype``: resolved (``engine.plan.ExecutionPlan.audio_dtype``). ``overlap``: collect at a later step
        (on CUDA: the decode runs on its own stream). ``buckets``: pad windows to fixed lengths.
        ``max_in_flight``: submissions not yet collected before ``submit`` waits for the oldest."""
        self.model, self.dtype, self.overlap, self.buckets = model, dtype, overlap, buckets
        self.device = device
        self.streams = streams or (CudaStreams(device) if device.type == "cuda" else InlineStreams())
        self.stream = self.streams.new() if overlap else self.streams.current()
        self.max_in_flight = max(1, max_in_flight)
        self._pending: deque[_Pending] = deque()
        self._busy: set[int] = set()  # id() of the AudioStreams with a window in flight

    def busy(self, stream: AudioStream) -> bool:
        """Whether a window of ``stream`` is in flight (its next window is not known before it is in)."""
        return id(stream) in self._busy

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def submit(self, entries: list[Entry]) -> list[tuple[list[Entry], list[np.ndarray | Exception]]]:
        """Queue the decode of ``entries`` (none of whose streams may be ``busy``); returns what had to
        be collected first to stay within ``max_in_flight`` (usually nothing)."""
        if any(self.busy(w.stream) for _, _, w in entries):
            raise ValueError("a window of this stream is already being decoded")
        out = []
        while len(self._pending) >= self.max_in_flight:
            out.append(self._take(self._pending.popleft()))
        if not entries:
            return out
        s = self.streams
        ready = s.record(s.current())  # after this step's hidden states were written
        windows = [w for _, _, w in entries]
        with s.use(self.stream):
            s.wait(self.stream, ready)
            for w in windows:
                s.keep(w.stream.hidden, self.stream)
            batches = decode_on_device(self.model, windows, self.dtype, buckets=self.buckets)
            host = [self._to_host(b.wav) if b.wav is not None else None for b in batches]
            done = s.record(self.stream)
        for b in batches:
            b.wav = None  # on the audio stream's pool: reused only by its later work, after the copy
        self._pending.append(_Pending(entries, batches, host, done))
        self._busy.update(id(w.stream) for w in windows)
        return out

    def collect(self, wait: bool) -> list[tuple[list[Entry], list[np.ndarray | Exception]]]:
        """The audio of every submission that is done, oldest first, as (entries, audio or error
        per entry); ``wait``: wait for all of them."""
        out = []
        while self._pending and (wait or self._pending[0].done.query()):
            out.append(self._take(self._pending.popleft()))
        return out

    def drop(self) -> None:
        """Forget every submission (after waiting for it: its buffers must outlive the kernels)."""
        while self._pending:
            self._pending.popleft().done.synchronize()
        self._busy.clear()

    def _to_host(self, wav: torch.Tensor) -> torch.Tensor:
        if not self.streams.pinned():
            return wav.cpu()
        host = host_empty(tuple(wav.shape), wav.dtype, self.device)
        host.copy_(wav, non_blocking=True)
        return host

    def _take(self, p: _Pending) -> tuple[list[Entry], list[np.ndarray | Exception]]:
        self._busy.difference_update(id(w.stream) for _, _, w in p.entries)
        audio: list[np.ndarray | Exception | None] = [None] * len(p.entries)
        try:
            p.done.synchronize()
        except Exception as exc:  # an asynchronous device error surfaces here: fail the whole submission
            logger.exception("audio decode failed on the device")
            return p.entries, [exc] * len(p.entries)
        pinned = self.streams.pinned()
        for batch, host in zip(p.batches, p.host, strict=True):
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
