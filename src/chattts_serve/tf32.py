"""TF32 on CUDA only where it was asked for, and only inside a scope: fp32 means fp32.

torch's TF32 switches (cuBLAS matmuls, cuDNN convolutions and RNNs) are process-wide; there is no
per-thread TF32. And cuDNN convolutions default to TF32, so "fp32" audio (the reference-exact
waveform: Decoder and Vocos are convolutions) and the DVAE encode ran their convolutions in TF32, and
a "tf32" decode that flipped the matmul switch for its duration flipped it for every other thread too.

So: ``strict_fp32`` sets the process baseline to IEEE fp32 for all of them (the engine does it once
at start-up on CUDA: the fp32 precision and ``--audio-dtype fp32`` are then fp32), and both scopes,
``tf32_scope`` (TF32 for the duration, then the baseline again) and ``fp32_scope`` (strict for the
duration, whatever the baseline), hold one lock: no other thread's precision scope runs inside
another's, so a DVAE encode on another thread waits for a TF32 decode's launches instead of running
in TF32. (The switches are read when a kernel is launched, so holding the lock around the launches
is enough; the engine makes its device calls on its one thread anyway, see ``chattts_serve.device``.)
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

_lock = threading.RLock()


def _switches() -> list[tuple[Any, str, Any, Any]]:
    """(object, attribute, strict value, TF32 value) of every switch. torch >= 2.9 (every CUDA torch
    this package supports) has the ``fp32_precision`` API; older ones the ``allow_tf32`` flags. One
    API only: torch refuses to read a mix of the two."""
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    if hasattr(matmul, "fp32_precision") and hasattr(cudnn, "conv"):
        ops = [matmul, cudnn.conv] + ([cudnn.rnn] if hasattr(cudnn, "rnn") else [])
        return [(op, "fp32_precision", "ieee", "tf32") for op in ops]
    return [(matmul, "allow_tf32", False, True), (cudnn, "allow_tf32", False, True)]


def state() -> dict[str, Any]:
    """The switches as they are now (for tests and logs)."""
    return {f"{type(obj).__name__}.{name}": getattr(obj, name) for obj, name, _, _ in _switches()}


def tf32_on() -> bool:
    """Whether any switch allows TF32 now."""
    return any(getattr(obj, name) == tf32 for obj, name, _, tf32 in _switches())


def strict_fp32() -> None:
    """The process baseline: IEEE fp32 for matmuls and convolutions (set once, at start-up on CUDA)."""
    with _lock:
        for obj, name, strict, _ in _switches():
            setattr(obj, name, strict)


@contextmanager
def _scope(tf32: bool) -> Iterator[None]:
    with _lock:
        switches = _switches()
        before = [getattr(obj, name) for obj, name, _, _ in switches]
        try:
            for obj, name, strict, on in switches:
                setattr(obj, name, on if tf32 else strict)
            yield
        finally:
            for (obj, name, _, _), value in zip(switches, before, strict=True):
                setattr(obj, name, value)


def tf32_scope() -> Any:
    """TF32 matmuls and convolutions for the duration (the "tf32" audio dtype), under the lock."""
    return _scope(True)


def fp32_scope() -> Any:
    """Strict fp32 for the duration (the "fp32" audio dtype, the DVAE encode), under the lock."""
    return _scope(False)
