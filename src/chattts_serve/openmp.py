"""The OpenMP runtime under torch's CPU ops: one thread pool in the process, the engine thread's.

torch's CPU build runs its intra-op work on libgomp, and libgomp gives every thread that opens a
parallel region a pool of its own, kept for the life of that thread. It also counts the threads of all
the pools together, and once they outnumber the CPUs it treats the machine as oversubscribed: an idle
pool thread then spins ~100 times (instead of ~300 000, a few ms) before it sleeps on a futex, so each of
the hundreds of barriers in a CPU step is a sleep and a wake-up of the other core's thread.

A served engine builds its model on one thread (the caller's: the model's load, packing, calibration and
graphs open parallel regions there) and steps on another, the ``AsyncEngine`` loop thread. On 2 CPUs the
two pools make 3 threads: every barrier of every step throttled for the life of the server. Measured on a
2-core Zen 4, a 32-stream burst (``bench streams --threads 2 --precision int4 --audio-dtype ov-int8``): the
loop thread's pool thread made ~35 000 voluntary context switches in one 14 s level, ~100 with the
building thread's pool freed; the burst's ~1888-token prefill took 1.97-2.43 s against 1.47-1.64 s, and
32 streams ran 6.9-8.4x real time against 8.3-10.4x (3 alternating pairs, BENCHMARKS.md).

``release_pool`` frees the calling thread's pool (OpenMP 5.0's ``omp_pause_resource_all``, which libgomp
implements for the host as exactly that); the ``AsyncEngine`` calls it on the thread that built the
engine, as the loop thread takes its steps from then on.

libgomp only (Linux builds of torch); under another OpenMP runtime (LLVM's libomp, Intel's libiomp5: no
such throttling) or none, nothing is done. The thread's own thread count is left as it was: a thread that
opens a parallel region again gets a new pool (and the throttling back), so the threads around a served
engine run no parallel torch work (the server's are: the event loop encodes audio with numpy and PyAV).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys

logger = logging.getLogger(__name__)

_OMP_PAUSE_SOFT = 1
"""``omp_pause_soft``: the pool's threads end; the runtime starts new ones when a region needs them."""


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp this process has loaded (torch's own copy), or None: not Linux, or another runtime."""
    if not sys.platform.startswith("linux"):
        return None
    import torch  # noqa: F401  (loads the OpenMP runtime torch was built with)

    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libgomp" in line and "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)  # the loaded copy (dlopen of a loaded path adds a reference)
            fn = lib.omp_pause_resource_all
        except (OSError, AttributeError):  # a libgomp older than OpenMP 5.0 (GCC 10)
            continue
        fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
        return lib
    return None


def release_pool() -> bool:
    """Free the calling thread's OpenMP thread pool (its threads end; see the module docstring). True when
    libgomp did; False where there is no libgomp or it refused (called inside a parallel region)."""
    lib = _libgomp()
    if lib is None:
        return False
    done = lib.omp_pause_resource_all(_OMP_PAUSE_SOFT) == 0
    if not done:
        logger.debug("omp_pause_resource_all refused: the calling thread keeps its OpenMP pool")
    return done
