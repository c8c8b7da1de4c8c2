"""The engine's device, named in every CUDA call that would otherwise take the thread's current one.

Why: torch's CUDA calls that take no device (``torch.cuda.Event().record()``, ``current_stream()``,
``Stream()``, ``torch.cuda.graph(...)`` without a stream, pinned allocations) use the calling thread's
*current* device, which is per thread and 0 unless set. An engine on ``cuda:1`` driven from a thread
whose current device is 0 would then record its token event on cuda:0's stream and wait on the wrong
card: the host reads the pinned token buffer before the copy lands (stale tokens, a missed EOS) and
rewrites pinned staging while copies from it are queued. So every stream, event and capture names the
engine's device (the helpers below), and the thread that drives an engine sets its device once
(``bind_thread``: the ``AsyncEngine`` loop, the offline worker, ``Engine.from_pretrained``), so the
calls that cannot take a device (pinned host memory, library kernels) land on the right card too.
``tests/test_device.py`` checks both: the device of every call under stand-in CUDA calls, and
(with ``ast``) that no bare call is left in the package.
"""

from __future__ import annotations

import threading
import weakref
from contextlib import AbstractContextManager, nullcontext

import torch


def is_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def bind_thread(device: torch.device) -> None:
    """Make ``device`` the calling thread's current CUDA device (a no-op elsewhere): once, by the
    thread that drives the engine, before its first device call."""
    if is_cuda(device):
        torch.cuda.set_device(device)


def on_device(device: torch.device) -> AbstractContextManager:
    """``device`` as the current CUDA device for the duration (capture and replay use the current one)."""
    return torch.cuda.device(device) if is_cuda(device) else nullcontext()


def current_stream(device: torch.device) -> torch.cuda.Stream:
    """The calling thread's current stream *of ``device``* (where its kernels and copies are queued)."""
    return torch.cuda.current_stream(device)


_POOL_SIZE = 32
"""Streams in torch's per-device pool (per priority): ``torch.cuda.Stream()`` hands them out round robin."""

_held: weakref.WeakSet = weakref.WeakSet()
"""Every stream ``new_stream`` handed out that someone still holds."""
_held_lock = threading.Lock()


def new_stream(device: torch.device) -> torch.cuda.Stream:
    """A side stream of ``device`` that no other holder of a ``new_stream`` stream has: torch's pool
    hands out its 32 streams round robin, so the 33rd ``Stream()`` is the first again. Two users
    sharing one stream lose their concurrency, and worse: cuBLAS keys its workspace by (handle,
    stream), so a graph captured on the audio stream would replay on the workspace the audio
    decode's matmuls are using. Raises when every pool stream of ``device`` is held."""
    with _held_lock:
        for _ in range(_POOL_SIZE + 1):
            stream = torch.cuda.Stream(device=device)
            if not any(stream == s for s in _held):
                _held.add(stream)
                return stream
    raise RuntimeError(f"every one of the {_POOL_SIZE} pooled CUDA streams of {device} is held")


def record_event(device: torch.device, event: torch.cuda.Event | None = None) -> torch.cuda.Event:
    """Record ``event`` (a new one if None) on ``device``'s current stream: it completes after every
    kernel and copy queued there so far."""
    if event is None:
        event = torch.cuda.Event()
    event.record(current_stream(device))
    return event


def host_empty(shape: int | tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host buffer for copies to and from ``device``: pinned on CUDA (allocated with ``device``
    current: pinning creates a CUDA context on the current device if it has none)."""
    if not is_cuda(device):
        return torch.empty(shape, dtype=dtype)
    with on_device(device):
        return torch.empty(shape, dtype=dtype, pin_memory=True)


def host_zeros(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``host_empty``, zeroed: a persistent staging buffer."""
    return host_empty(n, dtype, device).zero_()


def pinned_copy(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor ``t`` on ``device`` without blocking the host: through a pinned copy on CUDA (torch
    keeps the pinned block until the copy is done), a plain ``to`` elsewhere."""
    if not is_cuda(device):
        return t.to(device)
    with on_device(device):
        return t.pin_memory().to(device, non_blocking=True)
