"""A CPU batch's rows, several at once: one utterance per core.

On a CPU each row runs alone (``engine.batch.pads_rows``). One utterance spread over every core wastes much of
them: ALBERT and the LSTMs are short sequential kernels, and a convolution split in two pays its split. So when
a batch holds several rows, ``RowPool`` runs as many at once as torch has threads, each on one thread of its own
(torch's thread count is per calling thread under OpenMP, so the engine thread keeps its own); a batch of one row
runs on the calling thread with all of them for its decoder, for the lowest latency. The OpenVINO graph follows
the thread count of its caller (``kernels.session``: one stream per worker).

The text side runs on one thread either way (``KokoroModel.text_threads``): the LSTMs' last bits change with the
thread count, and F0 carries a 1-ulp change into the waveform's phase (measured: 1.5e-5 Hz of F0, 0.1 of audio,
full-size checkpoint). So a row's durations and F0 are the same alone or batched; its decoder's convolutions,
blocked differently on one thread than on several, move the waveform by rounding only (the bounds in
``tests/models/kokoro/test_rows.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TypeVar

import torch

Row = TypeVar("Row")
Result = TypeVar("Result")


@contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """This thread's torch ops on ``threads`` threads for the duration (None: unchanged). Per calling thread: torch's
    count is OpenMP's, which each thread holds for itself."""
    before = torch.get_num_threads()
    if threads is None or threads == before:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class RowPool:
    """``map`` runs rows ``workers`` at once, each worker on one torch thread; one row runs on the caller."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._pool = (ThreadPoolExecutor(workers, thread_name_prefix="kokoro-row", initializer=torch.set_num_threads,
                                         initargs=(1,)) if workers > 1 else None)

    def map(self, run: Callable[[Row], Result], rows: Sequence[Row]) -> list[Result]:
        if self._pool is None or len(rows) < 2:
            return [run(row) for row in rows]
        return list(self._pool.map(run, rows))  # in order; the first failure is raised here

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
