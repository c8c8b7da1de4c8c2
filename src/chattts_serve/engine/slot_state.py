"""Per-slot sampling state on the device, and the step's two host transfers.

Every running sequence owns a KV slot; what its sampling needs lives in tensors indexed by that slot
(``SlotState``): temperature per codebook row, top_p, top_k, repetition penalty, min_new_tokens, the
count of tokens generated, the last sampled token (the next step's input), the repetition-penalty
history ring, the prompt length (so cache positions are computed on the device) and the noise seed.
Admission writes a sequence's row with ``index_copy_``; a step gathers rows with ``index_select`` and
writes its tokens back with ``index_copy_`` / ``index_put_``: a fixed number of launches whatever the
batch, and nothing built from Python lists on the device.

The host talks to the device twice per step at most, through persistent buffers (pinned on CUDA):

- ``HostStaging``: admissions and the step's index tensors are written with numpy into one int64
  host buffer and go over in one ``non_blocking`` copy (floats travel as their float64 bits). Steps
  whose running set did not change stage nothing (the runner keeps their index tensors).
- ``TokenReadback``: the sampled tokens, one ``non_blocking`` copy into a host buffer and one event
  wait; the host then reads that buffer with ``tolist()``. This is the step's only device sync.

Reuse of the host buffers is safe without an extra wait. Staging alternates between two: a step writes
the one last copied from two flushes ago, whose copy is ahead (in stream order) of a step whose
tokens the host has waited for, even with the host one step ahead (``EngineCore``). The readback
alternates two buffers and two events likewise.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..device import host_zeros, record_event
from .sampler import PENALTY_WINDOW


@dataclass(frozen=True, slots=True)
class Admission:
    """One sequence's sampling row, as staged at admission."""

    slot: int
    prompt_len: int
    min_new_tokens: int
    top_k: int
    seed: int  # int64 (see ``noise.seed_value``); 0 where the generator path does not use it
    top_p: float
    repetition_penalty: float
    temperature: tuple[float, ...]  # one per codebook row (text: its one value repeated)


_INT_FIELDS = 5  # slot, prompt_len, min_new_tokens, top_k, seed
_FLOAT_FIELDS = 2  # top_p, repetition_penalty (then the temperatures)


class HostStaging:
    """Persistent int64 host buffers (pinned on CUDA) and their device twin: numpy writes, one copy.

    The host side is a ring of ``HOST_BUFFERS``: each ``flush`` copies from one and the next writes go to
    the other. With the host one step ahead of the device (``EngineCore``), the next step is staged
    before this step's copy has surely run; the buffer it writes was last copied from two flushes ago,
    at a step whose tokens the host has already waited for (see the module docstring)."""

    HOST_BUFFERS = 2

    def __init__(self, capacity: int, device: torch.device) -> None:
        self._hosts = [host_zeros(capacity, torch.int64, device) for _ in range(self.HOST_BUFFERS)]
        self._nps = [h.numpy() for h in self._hosts]
        self._turn = 0
        self.dev = torch.zeros(capacity, dtype=torch.int64, device=device)
        self.used = 0

    @property
    def host(self) -> torch.Tensor:
        """The host buffer the next ``put`` writes."""
        return self._hosts[self._turn]

    @property
    def hosts(self) -> list[torch.Tensor]:
        return list(self._hosts)

    def put(self, n: int) -> tuple[int, np.ndarray]:
        """Reserve ``n`` words: their offset and the numpy view to fill."""
        off = self.used
        buf = self._nps[self._turn]
        if off + n > len(buf):
            raise RuntimeError(f"staging buffer full: {off} + {n} > {len(buf)} words")
        self.used += n
        return off, buf[off : off + n]

    def flush(self) -> bool:
        """Copy what was staged to the device in one non-blocking copy; False when nothing was."""
        if not self.used:
            return False
        self.dev[: self.used].copy_(self._hosts[self._turn][: self.used], non_blocking=True)
        self.used = 0
        self._turn = (self._turn + 1) % self.HOST_BUFFERS
        return True

    def get(self, off: int, n: int) -> torch.Tensor:
        """The device words ``[off, off + n)`` after ``flush``."""
        return self.dev[off : off + n]


class TokenReadback:
    """The step's one device-to-host copy: sampled tokens into a persistent host buffer, one wait.

    ``start`` queues the copy and records its event; ``finish`` waits for that event and reads the
    buffer. Between them the host may queue the next step (``EngineCore`` runs one step ahead): two host
    buffers and two events alternate, so step n+1's copy never lands in the buffer step n is read from."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.device = device
        self._hosts = [host_zeros(capacity, torch.int64, device) for _ in range(2)]
        self._events = [torch.cuda.Event() if device.type == "cuda" else None for _ in range(2)]
        self._turn = 0

    @property
    def hosts(self) -> list[torch.Tensor]:
        return list(self._hosts)

    def start(self, tokens: torch.Tensor) -> tuple[int, int]:
        """Queue the copy of tokens ``[n]`` int64 (on the device) and record its event: a handle for ``finish``."""
        n, turn = tokens.shape[0], self._turn
        self._hosts[turn][:n].copy_(tokens, non_blocking=True)
        event = self._events[turn]
        if event is not None:
            # On the engine's device's stream, where the copy was queued (a bare ``record()`` records on
            # the thread's current device: cuda:0 for an engine on cuda:1, and the wait would not wait).
            record_event(self.device, event)
        self._turn = 1 - turn
        return turn, n

    def finish(self, handle: tuple[int, int]) -> np.ndarray:
        """Wait for the copy ``start`` queued -> a numpy view of it (valid until the next ``finish``)."""
        turn, n = handle
        event = self._events[turn]
        if event is not None:
            event.synchronize()
        return self._hosts[turn][:n].numpy()

    def read(self, tokens: torch.Tensor) -> np.ndarray:
        """``start`` and ``finish`` at once: tokens ``[n]`` -> a numpy view of the host copy."""
        return self.finish(self.start(tokens))


class SlotState:
    """Sampling state of every KV slot, on the device (see the module docstring)."""

    def __init__(self, num_slots: int, num_vq: int, device: torch.device) -> None:
        s, q = num_slots, num_vq
        self.num_vq = q

        def new(*shape, dtype=torch.int64, fill=0):
            return torch.full(shape, fill, dtype=dtype, device=device)

        self.temperature = new(s, q, dtype=torch.float32, fill=1)
        self.top_p = new(s, dtype=torch.float64, fill=1)
        self.top_k = new(s)
        self.penalty = new(s, dtype=torch.float32, fill=1)
        self.min_new_tokens = new(s)
        self.generated = new(s)
        """Tokens sampled since admission (the reference's step; indexes the history ring)."""
        self.prompt_len = new(s)
        self.seed = new(s)
        self.last = new(s, q)
        """The last sampled token per slot (text ids repeated over the codebook columns)."""
        self.history = new(s, q, PENALTY_WINDOW)
        self.window = torch.arange(PENALTY_WINDOW, device=device)
        self.codebooks = torch.arange(q, device=device)
        self.words = _INT_FIELDS + _FLOAT_FIELDS + q
        """Staging words per admission."""

    def stage(self, staging: HostStaging, rows: list[Admission]) -> int:
        """Write ``rows`` into the staging buffer (host only); returns their offset for ``admit``."""
        n, q = len(rows), self.num_vq
        off, block = staging.put(n * self.words)
        block = block.reshape(n, self.words)
        block[:, :_INT_FIELDS] = [(a.slot, a.prompt_len, a.min_new_tokens, a.top_k, a.seed) for a in rows]
        floats = block[:, _INT_FIELDS:].view(np.float64)
        floats[:] = [(a.top_p, a.repetition_penalty, *a.temperature) for a in rows]
        assert floats.shape[1] == _FLOAT_FIELDS + q
        return off

    def admit(self, staging: HostStaging, off: int, n: int) -> None:
        """After ``staging.flush``: write the staged rows into their slots (a fixed number of launches)."""
        block = staging.get(off, n * self.words).view(n, self.words)
        slots = block[:, 0]
        self.prompt_len.index_copy_(0, slots, block[:, 1])
        self.min_new_tokens.index_copy_(0, slots, block[:, 2])
        self.top_k.index_copy_(0, slots, block[:, 3])
        self.seed.index_copy_(0, slots, block[:, 4])
        floats = block[:, _INT_FIELDS:].view(torch.float64)
        self.top_p.index_copy_(0, slots, floats[:, 0])
        # float64 -> float32 rounds once, as torch.tensor(python_floats, dtype=float32) does.
        self.penalty.index_copy_(0, slots, floats[:, 1].float())
        self.temperature.index_copy_(0, slots, floats[:, _FLOAT_FIELDS:].float())
        self.generated.index_fill_(0, slots, 0)
        # Unwritten history entries are masked out, but still index the counts: keep them in any vocabulary.
        self.history.index_fill_(0, slots, 0)

    def positions(self, slots: torch.Tensor) -> torch.Tensor:
        """Cache position of each decoding slot's new token: prompt + tokens fed back so far."""
        return self.prompt_len.index_select(0, slots) + self.generated.index_select(0, slots) - 1

    def record(self, slots: torch.Tensor, generated: torch.Tensor, tokens: torch.Tensor) -> None:
        """tokens ``[n, rows]`` sampled for ``slots`` at step ``generated`` ``[n]``: into the history
        ring (column step % window), as the next input, and one more generated."""
        n, rows = tokens.shape
        col = generated.remainder(PENALTY_WINDOW)
        self.history.index_put_((slots[:, None], self.codebooks[None, :rows], col[:, None]), tokens)
        self.last.index_copy_(0, slots, tokens.expand(n, self.num_vq) if rows == 1 else tokens)
        self.generated.index_copy_(0, slots, generated + 1)

    def record_active(self, n: int, generated: torch.Tensor, tokens: torch.Tensor, active: torch.Tensor) -> None:
        """``record`` for slots ``0..n-1`` (rows are slots: the whole-step graph) where only the
        ``active`` ``[n]`` ones took a step: the others keep their history, last token and count (each
        is written back unchanged, so the launches do not depend on which rows are active)."""
        rows = tokens.shape[1]
        col = generated.remainder(PENALTY_WINDOW)[:, None, None].expand(n, rows, 1)
        history = self.history[:n, :rows]
        history.scatter_(2, col, torch.where(active[:, None, None], tokens[:, :, None], history.gather(2, col)))
        new_last = tokens.expand(n, self.num_vq) if rows == 1 else tokens
        last = self.last[:n]
        last.copy_(torch.where(active[:, None], new_last, last))
        self.generated[:n].copy_(torch.where(active, generated + 1, generated))
