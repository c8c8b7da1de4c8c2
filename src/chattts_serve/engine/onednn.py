"""oneDNN's caches of compiled kernels, bounded before the first one is made.

torch runs the packed linears and the audio convolutions on CPU through oneDNN, which JIT-compiles a
kernel ("primitive") per input shape and keeps it twice: in oneDNN's own primitive cache and in ideep's
LRU cache above it (torch's oneDNN wrapper), each holding up to 1024 entries by default. A server sees a
new shape with almost every request (each prompt length is a new prefill row count, each last chunk a
new convolution length), so both caches fill for thousands of requests: ~0.4 MB per shape, a steady
~0.3-0.5 MB of RSS per request until ~2 x 1024 entries (~800 MB) are held. memray found every byte of a
soak's growth there (BENCHMARKS.md, "soak"). 256 entries each still hold every shape a busy engine uses
from step to step (decode at each batch size, the chunk lengths): the stream and batch benchmarks ran
as fast with 64 as with 1024 (BENCHMARKS.md).

Both libraries read their capacity from the environment once, when their cache is first used; torch
exposes no call to change it later. So the engine sets the variables (unless the user did) before it
loads any weights; in a process that ran oneDNN work before that, they have no effect. No torch here.
"""

from __future__ import annotations

import os

CAPACITY_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
"""oneDNN's primitive cache; ideep's cache of primitives above it."""
DEFAULT_CAPACITY = 256


def bound_kernel_caches(capacity: int = DEFAULT_CAPACITY) -> dict[str, int]:
    """Set each cache's capacity to ``capacity`` unless its variable is already set (the user's choice
    wins); returns the capacities in effect."""
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    out = {}
    for name in CAPACITY_VARIABLES:
        value = os.environ.setdefault(name, str(capacity))
        try:
            out[name] = int(value)
        except ValueError:
            raise ValueError(f"{name} must be an integer, got {value!r}") from None
    return out
