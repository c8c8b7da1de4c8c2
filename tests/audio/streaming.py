"""Helpers for the tests of the per-stream audio processors (``StreamingResampler``, ``StreamingStretcher``):
both take chunks with ``process`` and end with ``flush``."""

from __future__ import annotations

import numpy as np

SR = 24000


def sine(freq: float, seconds: float, rate: int = SR) -> np.ndarray:
    return (0.5 * np.sin(2 * np.pi * freq * np.arange(int(seconds * rate)) / rate)).astype(np.float32)


def fed_in_chunks(processor, pcm: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """What ``processor`` gives for ``pcm`` fed in chunks of ``sizes`` (the rest last), then flushed."""
    out, i = [], 0
    for n in sizes:
        out.append(processor.process(pcm[i : i + n]))
        i += n
    out.append(processor.process(pcm[i:]))
    out.append(processor.flush())
    return np.concatenate(out)
