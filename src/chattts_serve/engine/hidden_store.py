"""The hidden states of every live audio stream in one shared device tensor, written once per step.

Each code sequence's ``AudioStream`` keeps the hidden state of every step it generated (the Decoder
turns them into mel). Written stream by stream, that was one small copy kernel per sequence per step.
Here every stream owns a *row* ``[max_steps, hidden]`` of one block ``[rows, max_steps, hidden]`` (the
stream's buffer is a view of it, so windows are still plain slices), and the pipeline writes a whole
step's states with one ``index_copy_``: the destinations ``row * max_steps + step`` and the source rows
travel to the device together in one copy from a pinned staging buffer.

The block is allocated once, at start-up, and never grows: a growth mid-serving would allocate
gigabytes outside the memory rule (``runner.slot_bytes``) and stall the step that did it. It has a row
per KV slot plus ``HEADROOM`` (a finished stream keeps its row until its last window is decoded, a
step or two after its slot was given to the next sequence), and the scheduler admits a code sequence
only while a row is free (``rows_free``), so ``acquire`` never runs dry. Rows return to the pool as
soon as their stream is done (its last window decoded) or dropped; a window already submitted reads
its rows before any later step's write to them in stream order (an aborted request's window may read
a reused row on the audio stream: its audio is discarded).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .slot_state import HostStaging

HEADROOM = 0.125
"""Rows beyond one per KV slot (a share of the slots, at least 2): streams whose sequence has ended
but whose last window is still being decoded. Counted in each slot's bytes (``slot_bytes``)."""


def rows_for(num_slots: int) -> int:
    """The store's rows for ``num_slots`` KV slots: one each, and the headroom."""
    return num_slots + max(2, math.ceil(num_slots * HEADROOM))


class HiddenStore:
    def __init__(self, hidden_size: int, max_steps: int, device: torch.device, rows: int = 16) -> None:
        """``max_steps``: the longest stream (``max_model_len`` bounds every sequence's new tokens);
        ``rows``: streams held at once (the engine passes ``rows_for(slots)``)."""
        if max_steps < 1 or rows < 1:
            raise ValueError(f"need max_steps >= 1 and rows >= 1, got {max_steps}, {rows}")
        self.hidden_size, self.max_steps, self.device = hidden_size, max_steps, device
        self.block = torch.zeros(rows, max_steps, hidden_size, dtype=torch.float32, device=device)
        self._flat = self.block.view(-1, hidden_size)
        self._free = list(range(rows - 1, -1, -1))  # popped from the end: row 0 first
        # Two words (destination, source) per stream written in a step, at most one step per row.
        self._staging = HostStaging(2 * rows, device)
        self._pending: list[tuple[int, int]] = []  # this step's (flat destination, source row)

    @staticmethod
    def bytes_per_row(hidden_size: int, max_steps: int) -> int:
        """One stream's row (fp32 hidden states of up to ``max_steps`` steps)."""
        return max_steps * hidden_size * 4

    @staticmethod
    def bytes_per_slot(hidden_size: int, max_steps: int) -> int:
        """What the store costs per KV slot: a row and the slot's share of the headroom (part of
        ``runner.slot_bytes``)."""
        return math.ceil(HiddenStore.bytes_per_row(hidden_size, max_steps) * (1 + HEADROOM))

    @property
    def rows(self) -> int:
        return self.block.shape[0]

    @property
    def rows_free(self) -> int:
        return len(self._free)

    def acquire(self, steps: int) -> tuple[int, torch.Tensor]:
        """A free row for a stream of at most ``steps`` steps: its handle and its ``[steps, hidden]`` view.
        Raises RuntimeError when none is free (the scheduler admits code sequences only while one is)."""
        if not 1 <= steps <= self.max_steps:
            raise ValueError(f"a stream of {steps} steps does not fit rows of {self.max_steps}")
        if not self._free:
            raise RuntimeError(f"every one of the hidden-state store's {self.rows} rows is in use")
        row = self._free.pop()
        return row, self.block[row, :steps]

    def release(self, row: int) -> None:
        self._free.append(row)

    def stage(self, row: int, step: int, source_row: int) -> None:
        """Queue: step ``step`` of the stream in ``row`` is row ``source_row`` of the hidden states
        given to the next ``write``."""
        self._pending.append((row * self.max_steps + step, source_row))

    def write(self, hidden: torch.Tensor | None) -> None:
        """Write every staged step from ``hidden`` ``[n, hidden]`` (one staging copy, one
        ``index_select`` and one ``index_copy_``)."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        if hidden is None:
            raise RuntimeError(f"{len(pending)} hidden states staged but none given")
        n = len(pending)
        off, buf = self._staging.put(2 * n)
        buf.reshape(2, n)[:] = np.array(pending, dtype=np.int64).T  # destinations, then sources
        self._staging.flush()
        dev = self._staging.get(off, 2 * n)
        self._flat.index_copy_(0, dev[:n], hidden.index_select(0, dev[n:]))
