"""``frozen_start_up()``: a server's start-up objects out of the cyclic garbage collector's walks.

A loaded engine leaves ~400 000 objects the collector tracks (torch's and OpenVINO's modules, the model's,
the tokenizers'; 410 000 for the full ChatTTS in ``int4`` with ``ov-int8`` audio), none of which becomes
garbage while the server runs. A full (generation 2) collection walks every one of them holding the GIL:
~200 ms on a Zen 4 core (BENCHMARKS.md), during which the engine thread, the event loop and with them every
stream stand still, whenever enough objects have survived since the last one. ``gc.freeze()`` moves what is
alive at start-up to the permanent generation, which no collection walks: a full collection afterwards
walks what was made since. (vLLM freezes its start-up heap the same way.)

Garbage made before the freeze is collected first (a frozen cycle would never be freed), and the freeze is
undone when the last server in the process stops, so a process that starts and stops servers gets its
collector back whole. A process whose heap something else had frozen before the first server started (the
test harness freezes its collected heap) keeps the collector as that owner set it: ``gc`` cannot unfreeze
part of the permanent generation, so the servers there neither freeze nor unfreeze."""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_servers = 0  # servers between their start-up and their stop, in this process
_ours = False  # whether the permanent generation is the servers' (nothing was frozen before the first one)


@contextmanager
def frozen_start_up() -> Iterator[None]:
    """Collect, then freeze everything alive; unfreeze when the last server using this stops (neither where
    something else froze objects first)."""
    global _servers, _ours
    with _lock:
        if _servers == 0:
            _ours = gc.get_freeze_count() == 0
        _servers += 1
        took = None
        if _ours:
            t0 = time.perf_counter()
            gc.collect()
            took = time.perf_counter() - t0
            gc.freeze()  # again for a second server: what the first one's start-up made since joins
    if took is not None:
        logger.info(
            "gc: %d start-up objects frozen (a full collection walking them took %.0f ms)",
            gc.get_freeze_count(),
            1e3 * took,
        )
    try:
        yield
    finally:
        with _lock:
            _servers -= 1
            if _servers == 0 and _ours:
                gc.unfreeze()
