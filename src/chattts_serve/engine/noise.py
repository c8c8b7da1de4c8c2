"""The exponential noise ``E`` of the sampler's draw ``argmax(p / E)`` (``sampler.sample_with_noise``).

Two sources, chosen by ``RunnerConfig.sampling_noise`` (settled once: ``engine.plan``):

``generator`` (CPU default): one ``torch.Generator`` per sequence and ``exponential_`` on a tensor of
the rows' shape, exactly what ``torch.multinomial(p, 1, generator)`` draws. A seeded sequence
re-seeds before every step, as the reference's ``manual_seed`` does, so it reuses one draw for the
whole sequence; an unseeded one draws on from its generator, seeded at admission from the global
RNG. **This is the reference-identical path**: with fp32 on the CPU at batch 1 the codes equal
chattts's bit for bit (tests/fidelity). It costs one launch per sequence per step.

``counter`` (CUDA default): ``E = -log(u)`` with ``u`` a pure function of (seed, step, row,
column): a splitmix64 hash in int64 tensor ops, for every row of the batch in one call. Nothing is
kept between steps and no generator object exists, so a batch of any mix of seeded and unseeded
sequences draws in a fixed number of launches, the draw can sit inside a captured graph, and a
request's codes depend only on its own seed and step (batch-invariant, deterministic). It is *not*
the reference's random stream: codes differ from chattts's for the same seed (same distribution).
The step counts every draw, seeded or not; unlike the reference, a seeded sequence does not reuse
one draw. Unseeded sequences take a seed from the global RNG at admission, so ``torch.manual_seed``
still makes unseeded runs repeatable.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def _signed(x: int) -> int:
    """A 64-bit pattern as the int64 value torch stores for it."""
    x &= _MASK64
    return x - (1 << 64) if x >> 63 else x


def seed_value(seed: int) -> int:
    """Any Python int seed as the int64 the counter hashes (its low 64 bits)."""
    return _signed(seed)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's ``>>`` is arithmetic: it copies the sign)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (multiplication wraps modulo 2^64, as on the hardware)."""
    x = x ^ _shr(x, 30)
    x = x * _signed(_MIX1)
    x = x ^ _shr(x, 27)
    x = x * _signed(_MIX2)
    return x ^ _shr(x, 31)


def mix64_(x: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """``mix64`` in place on ``x`` with one ``scratch`` tensor of its shape: the same bits in two
    buffers instead of ten fresh ones (at 512 sequences x 4 codebooks x 626 codes a buffer is 10 MB,
    and on a CPU the allocator's page faults for ten of them per step cost more than the math)."""
    for shift, mul in ((30, _MIX1), (27, _MIX2), (31, None)):
        torch.bitwise_right_shift(x, shift, out=scratch).bitwise_and_((1 << (64 - shift)) - 1)
        x.bitwise_xor_(scratch)
        if mul is not None:
            x.mul_(_signed(mul))
    return x


def mix64_int(x: int) -> int:
    """``mix64`` on one Python int (a reference for the tests), as an unsigned 64-bit value."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * _MIX1) & _MASK64
    x = ((x ^ (x >> 27)) * _MIX2) & _MASK64
    return x ^ (x >> 31)


class CounterNoise:
    """Counter-based Exp(1) noise for batched rows; keeps only the per-(rows, vocab) cell offsets."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cells: dict[tuple[int, int], torch.Tensor] = {}

    def _cell_offsets(self, rows: int, vocab: int) -> torch.Tensor:
        """``(cell + 1) * golden`` for every (row, column) of one sequence, flattened ``[rows * vocab]``."""
        key = (rows, vocab)
        if key not in self._cells:
            cells = torch.arange(1, rows * vocab + 1, dtype=torch.int64, device=self.device)
            self._cells[key] = cells * _signed(_GOLDEN)
        return self._cells[key]

    def __call__(self, seed: torch.Tensor, step: torch.Tensor, rows: int, vocab: int) -> torch.Tensor:
        """seed, step ``[n]`` int64 -> noise ``[n * rows, vocab]`` float32, row b * rows + q.

        Two splitmix64 levels: the sequence's stream at position ``step`` gives a base, and the cell
        (q, column) indexes a second stream from that base. The top 52 bits make ``u`` in (0, 1)
        (never 0, so E is finite), and ``-log`` runs in float64 before the one rounding to float32."""
        base = mix64(seed + (step + 1) * _signed(_GOLDEN))  # [n]
        h = base[:, None] + self._cell_offsets(rows, vocab)[None, :]  # [n, rows * vocab]
        scratch = torch.empty_like(h)
        mix64_(h, scratch)
        torch.bitwise_right_shift(h, 12, out=scratch).bitwise_and_((1 << 52) - 1)
        u = scratch.double().add_(0.5).mul_(2.0**-52)
        return u.log_().neg_().float().view(-1, vocab)


class GeneratorNoise:
    """The reference-identical source: one ``torch.Generator`` per slot (see the module docstring)."""

    def __init__(self, num_slots: int, device: torch.device) -> None:
        self.device = device
        self._generators: list[torch.Generator | None] = [None] * num_slots
        self._fixed: list[torch.Tensor | None] = [None] * num_slots

    def admit(self, slot: int, seed: int, seeded: bool, rows: int, vocab: int) -> None:
        """A new sequence in ``slot``. Seeded: its one draw now (the reference re-seeds before every
        step, so every step reuses it). Unseeded: a generator seeded with ``seed``."""
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed)
        if seeded:
            noise = torch.empty((rows, vocab), device=self.device).exponential_(1, generator=generator)
            self._generators[slot], self._fixed[slot] = None, noise
        else:
            self._generators[slot], self._fixed[slot] = generator, None

    def release(self, slot: int) -> None:
        self._generators[slot] = self._fixed[slot] = None

    def __call__(self, slots: list[int], rows: int, vocab: int) -> torch.Tensor:
        """Noise ``[len(slots) * rows, vocab]`` for these slots' sequences, in order."""
        parts = []
        for slot in slots:
            fixed = self._fixed[slot]
            if fixed is None:
                generator = self._generators[slot]
                if generator is None:  # never the global RNG by mistake
                    raise RuntimeError(f"slot {slot} has no sampling state")
                fixed = torch.empty((rows, vocab), device=self.device).exponential_(1, generator=generator)
            parts.append(fixed)
        return torch.cat(parts) if len(parts) > 1 else parts[0]
