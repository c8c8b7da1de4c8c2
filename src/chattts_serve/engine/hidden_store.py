"""The hidden states of every live audio stream in a few shared device tensors, written once per step.

Each code sequence's ``AudioStream`` keeps the hidden state of every step it generated (the Decoder
turns them into mel). Written stream by stream, that was one small copy kernel per sequence per step.
Here every stream owns a *row* ``[max_steps, hidden]`` of a shared block ``[rows, max_steps, hidden]``
(the stream's buffer is a view of it, so windows are still plain slices), and the pipeline writes a
whole step's states with one ``index_copy_`` per block: the destinations ``row * max_steps + step``
and the source rows travel to the device together in one staging copy.

Blocks are never resized (streams hold views of them): when every row is taken a new block with as
many rows as all the others together is added, so a step touches O(log rows) blocks, one when the
first block is sized to the KV slots. Rows return to the pool when their stream is done or dropped;
a window already submitted reads its rows before any later step's write to them in stream order (an
aborted request's window may read a reused row on the audio stream: its audio is discarded).
"""

from __future__ import annotations

import numpy as np
import torch

from .slot_state import HostStaging


class HiddenStore:
    def __init__(self, hidden_size: int, max_steps: int, device: torch.device, first_rows: int = 16) -> None:
        """``max_steps``: the longest stream (``max_model_len`` bounds every sequence's new tokens);
        ``first_rows``: rows of the first block (the engine passes its KV slots)."""
        if max_steps < 1 or first_rows < 1:
            raise ValueError(f"need max_steps >= 1 and first_rows >= 1, got {max_steps}, {first_rows}")
        self.hidden_size, self.max_steps, self.device = hidden_size, max_steps, device
        self.first_rows = first_rows
        self.blocks: list[torch.Tensor] = []
        self._free: list[tuple[int, int]] = []  # (block, row), handed out lowest first
        self._staging: HostStaging | None = None
        self._pending: list[tuple[int, int, int]] = []  # this step's (block, flat destination, source row)

    @staticmethod
    def bytes_per_row(hidden_size: int, max_steps: int) -> int:
        """One stream's row (fp32 hidden states of up to ``max_steps`` steps): part of what a KV slot
        costs, since the first block has a row per slot (``runner.slot_bytes``)."""
        return max_steps * hidden_size * 4

    @property
    def rows(self) -> int:
        return sum(b.shape[0] for b in self.blocks)

    @property
    def rows_free(self) -> int:
        return len(self._free)

    def acquire(self, steps: int) -> tuple[tuple[int, int], torch.Tensor]:
        """A free row for a stream of at most ``steps`` steps: its handle and its ``[steps, hidden]`` view."""
        if not 1 <= steps <= self.max_steps:
            raise ValueError(f"a stream of {steps} steps does not fit rows of {self.max_steps}")
        if not self._free:
            self._grow()
        handle = self._free.pop()
        b, r = handle
        return handle, self.blocks[b][r, :steps]

    def release(self, handle: tuple[int, int]) -> None:
        self._free.append(handle)

    def _grow(self) -> None:
        n = max(self.first_rows, self.rows)
        b = len(self.blocks)
        self.blocks.append(torch.zeros(n, self.max_steps, self.hidden_size, dtype=torch.float32, device=self.device))
        self._free += [(b, r) for r in range(n - 1, -1, -1)]  # popped from the end: row 0 first

    def stage(self, handle: tuple[int, int], step: int, source_row: int) -> None:
        """Queue: step ``step`` of the stream in ``handle`` is row ``source_row`` of the hidden states
        given to the next ``write``."""
        b, r = handle
        self._pending.append((b, r * self.max_steps + step, source_row))

    def write(self, hidden: torch.Tensor | None) -> None:
        """Write every staged step from ``hidden`` ``[n, hidden]`` (one staging copy, one
        ``index_select`` and one ``index_copy_`` per block touched)."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        if hidden is None:
            raise RuntimeError(f"{len(pending)} hidden states staged but none given")
        n = len(pending)
        table = np.array(pending, dtype=np.int64).T  # [3, n]: block, destination, source
        st = self._staging
        if st is None or len(st.host) < 2 * n:
            st = self._staging = HostStaging(max(2 * n, 2 * self.first_rows), self.device)
        off, buf = st.put(2 * n)
        buf[:n], buf[n:] = table[1], table[2]
        st.flush()
        dev = st.get(off, 2 * n)
        dst, src = dev[:n], dev[n:]
        if len(self.blocks) == 1 or (table[0] == table[0, 0]).all():
            self._flat(int(table[0, 0])).index_copy_(0, dst, hidden.index_select(0, src))
            return
        for b in np.unique(table[0]).tolist():  # after a pool growth: one copy per block
            sel = np.flatnonzero(table[0] == b)
            idx = torch.from_numpy(sel).to(self.device)
            self._flat(b).index_copy_(0, dst[idx], hidden.index_select(0, src[idx]))

    def _flat(self, b: int) -> torch.Tensor:
        return self.blocks[b].view(-1, self.hidden_size)
