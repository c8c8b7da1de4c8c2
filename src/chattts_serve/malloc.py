"""glibc's malloc on a CPU engine: big tensors reuse the heap's pages instead of fresh mappings each time.

A CPU step allocates and frees tensors of tens of MB every call (a 2048-token prompt's gate/up projection
is 50 MB of fp32; the audio stage's activations alike). glibc serves a block that large with a fresh
``mmap`` and unmaps it on ``free`` (its threshold adapts only up to 32 MB), so every such tensor is
page-faulted in again, 4 KB at a time: filling a fresh 50 MB tensor took 11.7 ms against 1.9 ms for one
from the heap (Zen 5 VM, 2 threads). ``keep_big_blocks`` raises the mmap threshold and the trim threshold
to ``HEAP_BYTES``: blocks up to that size come from the heap and go back to it, and up to that much free
memory stays mapped at the heap's top for the next step (32 texts x 150 tokens, int4, ov-int8 audio, 5
interleaved pairs: 11.2-13.9x real time without, 13.7-15.5x with, median +12 %; BENCHMARKS.md). Larger
blocks (a big KV cache) are mapped as before, and a process keeps at most ``HEAP_BYTES`` of freed memory
beyond its working set.

Where it applies: Linux with glibc (``mallopt``); elsewhere, or under another allocator (jemalloc or
tcmalloc preloaded: they serve ``malloc`` themselves and glibc's settings go unused), nothing changes.
``CHATTTS_MALLOC=system`` leaves glibc's defaults. The engine calls it once, at start-up on a CPU.

Memory a step streams through every time (the int4 decode step's 97 MB of packed weights) gets its own
mapping advised for transparent huge pages (``huge_pages``): read in 4 KB pages, a one-row step takes ~24 000
TLB misses; on 2 MB pages the same step ran 5-9 % faster (Zen 5, 1 thread: 3.79-3.97 -> 3.54-3.63 ms). Linux
only (``madvise``; the kernel's ``transparent_hugepage`` setting must be "madvise" or "always"); elsewhere, or
with ``CHATTTS_MALLOC=system``, a plain tensor.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import os
import sys

import torch

logger = logging.getLogger(__name__)

MODE_ENV = "CHATTTS_MALLOC"
""""auto" (default): ``keep_big_blocks`` on glibc; "system": glibc's own defaults."""
HEAP_BYTES = 512 << 20
"""Blocks up to this size come from the heap; this much free memory may stay mapped at its top."""
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def _mode() -> str:
    mode = os.environ.get(MODE_ENV, "auto")
    if mode not in ("auto", "system"):
        raise ValueError(f"{MODE_ENV} must be 'auto' or 'system', got {mode!r}")
    return mode


@functools.cache
def keep_big_blocks() -> bool:
    """Once per process: glibc's thresholds raised to ``HEAP_BYTES`` (see the module docstring). Returns
    whether they were (False: not Linux glibc, or ``CHATTTS_MALLOC=system``)."""
    if _mode() == "system" or not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # musl, or no glibc by that name
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = mallopt(_M_MMAP_THRESHOLD, HEAP_BYTES) == 1 and mallopt(_M_TRIM_THRESHOLD, HEAP_BYTES) == 1
    if not done:
        logger.warning("glibc's mallopt refused the heap thresholds: big CPU tensors are mapped fresh each time")
    return done


def huge_pages(nbytes: int) -> torch.Tensor:
    """``nbytes`` of uint8 (uninitialised) in a mapping of their own, advised for transparent huge pages
    (module docstring); a plain ``torch.empty`` where that cannot be done. The tensor keeps the mapping alive."""
    advise = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only
    if nbytes <= 0 or advise is None or _mode() == "system":
        return torch.empty(nbytes, dtype=torch.uint8)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mapping.madvise(advise)  # before the first touch: pages are faulted in huge where the kernel can
    except OSError as e:  # a kernel built without transparent huge pages
        logger.debug("madvise(MADV_HUGEPAGE) refused (%s): 4 KB pages", e)
    return torch.frombuffer(mapping, dtype=torch.uint8)
