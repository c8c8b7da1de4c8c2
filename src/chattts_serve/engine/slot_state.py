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

Reuse of the staging buffer is safe without an extra wait: the next step writes it only after this
step's token wait, and the tokens are computed after (in stream order) the copy that read it.
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
    """One persistent int64 host buffer (pinned on CUDA) and its device twin: numpy writes, one copy."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.host = host_zeros(capacity, torch.int64, device)
        self._np = self.host.numpy()
        self.dev = torch.zeros(capacity, dtype=torch.int64, device=device)
        self.used = 0

    def put(self, n: int) -> tuple[int, np.ndarray]:
        """Reserve ``n`` words: their offset and the numpy view to fill."""
        off = self.used
        if off + n > len(self._np):
            raise RuntimeError(f"staging buffer full: {off} + {n} > {len(self._np)} words")
        self.used += n
        return off, self._np[off : off + n]

    def flush(self) -> bool:
        """Copy what was staged to the device in one non-blocking copy; False when nothing was."""
        if not self.used:
            return False
        self.dev[: self.used].copy_(self.host[: self.used], non_blocking=True)
        self.used = 0
        return True

    def get(self, off: int, n: int) -> torch.Tensor:
        """The device words ``[off, off + n)`` after ``flush``."""
        return self.dev[off : off + n]


class TokenReadback:
    """The step's one device-to-host copy: sampled tokens into a persistent host buffer, one wait."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.device = device
        self.host = host_zeros(capacity, torch.int64, device)
        self._event = torch.cuda.Event() if device.type == "cuda" else None

    def read(self, tokens: torch.Tensor) -> np.ndarray:
        """tokens ``[n]`` int64 on the device -> a numpy view of the host copy (valid until the next read)."""
        n = tokens.shape[0]
        self.host[:n].copy_(tokens, non_blocking=True)
        if self._event is not None:
            # On the engine's device's stream, where the copy was queued (a bare ``record()`` records on
            # the thread's current device: cuda:0 for an engine on cuda:1, and the wait would not wait).
            record_event(self.device, self._event).synchronize()
        return self.host[:n].numpy()


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
