"""engine/sampler.py: the batched path (``batched_probs`` + ``sample_with_noise``) against the
single-sequence oracle (``sampler_oracle.process_logits`` + ``sample``), bit for bit.

Each "sequence" owns 1 row (text) or 4 rows (code, one per codebook) with its own temperature(s),
top_p, top_k, repetition penalty, generated history and min_new_tokens. The batched call gets the
history as the runner keeps it: a ring buffer of the last 16 tokens plus a validity mask
(``runner._SeqState.history`` / ``record()``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from chattts_serve.engine.sampler import PENALTY_WINDOW, batched_probs, effective_top_k, sample_with_noise

from .sampler_oracle import process_logits, sample

EOS = 625
VOCAB = 626


@dataclass
class FakeSeq:
    rows: int
    temperature: tuple[float, ...]
    top_p: float
    top_k: int
    penalty: float
    min_new_tokens: int
    history: torch.Tensor  # [rows, n] every generated token, oldest first

    @property
    def n(self) -> int:
        return self.history.shape[1]

    @property
    def blocks_eos(self) -> bool:
        return self.n < self.min_new_tokens

    def ring(self) -> torch.Tensor:
        """The runner's ring buffer: token of step s at column s % 16 (zeros where never written)."""
        ring = torch.zeros(self.rows, PENALTY_WINDOW, dtype=torch.long)
        for step in range(self.n):
            ring[:, step % PENALTY_WINDOW] = self.history[:, step]
        return ring

    def valid(self) -> torch.Tensor:
        return (torch.arange(PENALTY_WINDOW) < min(self.n, PENALTY_WINDOW)).expand(self.rows, PENALTY_WINDOW)


def make_seqs(seed: int, count: int, vocab: int = VOCAB) -> list[FakeSeq]:
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for i in range(count):
        rows = rng.choice([1, 4])
        if rows == 4 and rng.random() < 0.5:
            temps = tuple(rng.choice([0.05, 0.3, 0.7, 1.0, 1.7]) for _ in range(4))
        else:
            temps = (rng.choice([0.05, 0.3, 0.7, 1.0, 1.7]),) * rows
        n = [0, 1, 5, 15, 16, 17, 31, 40][i % 8] if i < 8 else rng.randint(0, 40)
        # Few distinct ids, so repeats (penalty exponents > 1) are common; EOS in the mix sometimes.
        pool = torch.tensor(rng.sample(range(vocab), 6) + ([EOS] if rng.random() < 0.3 else []))
        history = pool[torch.randint(len(pool), (rows, n), generator=g)]
        top_p = rng.choice([1.0, 0.95, 0.7, 0.3, 0.01])
        min_new = rng.choice([0, 0, n, n + 1, 50])
        seqs.append(
            FakeSeq(
                rows=rows,
                temperature=temps,
                top_p=top_p,
                top_k=rng.choice([0, 1, 3, 20, 100, vocab, vocab + 50]),
                penalty=rng.choice([1.0, 1.05, 1.3, 0.9]),
                min_new_tokens=min_new,
                history=history,
            )
        )
    return seqs


def make_logits(seqs: list[FakeSeq], seed: int, vocab: int = VOCAB) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1000)
    out = []
    for s in seqs:
        lg = torch.randn(s.rows, vocab, generator=g) * 4.0
        if s.rows == 4:
            lg[1, 10:20] = lg[1, 9]  # ties at the top-k boundary
        lg[0, EOS] = lg[0].max() + 1.0  # EOS would dominate unless blocked
        out.append(lg)
    return out


def single_probs(s: FakeSeq, logits: torch.Tensor) -> torch.Tensor:
    return process_logits(
        logits,
        s.history,
        temperature=torch.tensor(s.temperature, dtype=torch.float32).view(s.rows, 1),
        repetition_penalty=s.penalty,
        top_p=s.top_p,
        top_k=s.top_k,
        block_eos_id=EOS if s.blocks_eos else None,
    )


def batch_probs(seqs: list[FakeSeq], logits: list[torch.Tensor]) -> torch.Tensor:
    """Exactly the tensors ``ModelRunner._sample`` builds."""
    reps = torch.tensor([s.rows for s in seqs])

    def per_row(values, dtype):
        return torch.tensor(values, dtype=dtype).repeat_interleave(reps)

    return batched_probs(
        torch.cat(logits),
        torch.cat([s.ring() for s in seqs]),
        torch.cat([s.valid() for s in seqs]),
        torch.cat([torch.tensor(s.temperature, dtype=torch.float32).view(s.rows, 1) for s in seqs]),
        per_row([s.penalty for s in seqs], torch.float32)[:, None],
        per_row([s.top_p for s in seqs], torch.float64)[:, None],
        per_row([s.top_k for s in seqs], torch.long),
        max(effective_top_k(s.top_k, logits[0].shape[-1]) for s in seqs),
        per_row([s.blocks_eos for s in seqs], torch.bool) if any(s.blocks_eos for s in seqs) else None,
        EOS,
    )


def split(probs: torch.Tensor, seqs: list[FakeSeq]) -> list[torch.Tensor]:
    return list(torch.split(probs, [s.rows for s in seqs]))


@pytest.mark.parametrize("seed", range(6))
def test_batched_probs_bit_identical_to_single(seed):
    seqs = make_seqs(seed, 24)
    logits = make_logits(seqs, seed)
    got = split(batch_probs(seqs, logits), seqs)
    for i, (s, lg, p) in enumerate(zip(seqs, logits, got, strict=True)):
        want = single_probs(s, lg)
        assert p.dtype == want.dtype == torch.float32
        assert torch.equal(p, want), f"sequence {i}: {s}"
        if s.blocks_eos:
            assert (p[:, EOS] == 0).all()


def test_cases_cover_the_interesting_settings():
    seqs = [s for seed in range(6) for s in make_seqs(seed, 24)]
    assert {s.top_k for s in seqs} >= {0, 1, 3, 20}
    assert {s.penalty for s in seqs} >= {1.0, 1.05}
    assert {s.top_p for s in seqs} >= {1.0, 0.7}
    assert {s.n for s in seqs} >= {0, 1, 15, 16, 17, 40}
    assert any(s.blocks_eos for s in seqs) and not all(s.blocks_eos for s in seqs)
    assert any(len(set(s.temperature)) > 1 for s in seqs)


def test_all_eos_blocked_or_none_blocked():
    for block in (True, False):
        seqs = make_seqs(42, 10)
        for s in seqs:
            s.min_new_tokens = 10_000 if block and s.top_p < 1.0 else 0
        logits = make_logits(seqs, 42)
        for s, lg, p in zip(seqs, logits, split(batch_probs(seqs, logits), seqs), strict=True):
            assert torch.equal(p, single_probs(s, lg))


@pytest.mark.parametrize("seed", range(3))
def test_penalty_one_in_every_row(seed):
    """The batched path skips the penalty when every row's is 1 (the refine default); the mixed batches
    above apply it with alpha = 1 in those rows. Both equal the oracle."""
    seqs = make_seqs(50 + seed, 24)
    for s in seqs:
        s.penalty = 1.0
    logits = make_logits(seqs, 50 + seed)
    for s, lg, p in zip(seqs, logits, split(batch_probs(seqs, logits), seqs), strict=True):
        assert torch.equal(p, single_probs(s, lg))


@pytest.mark.parametrize("seed", range(3))
def test_row_results_do_not_depend_on_the_batch(seed):
    seqs = make_seqs(100 + seed, 20)
    logits = make_logits(seqs, 100 + seed)
    full = split(batch_probs(seqs, logits), seqs)
    rng = random.Random(seed)
    for trial in range(6):
        if trial % 2:
            pick = rng.sample(range(len(seqs)), len(seqs))  # permutation
        else:
            pick = sorted(rng.sample(range(len(seqs)), rng.randint(1, 6)))  # subset
        sub = split(batch_probs([seqs[i] for i in pick], [logits[i] for i in pick]), [seqs[i] for i in pick])
        for j, i in enumerate(pick):
            assert torch.equal(sub[j], full[i]), f"trial {trial}: sequence {i}"
    for i in range(len(seqs)):  # and alone
        assert torch.equal(batch_probs([seqs[i]], [logits[i]]), full[i])


# ---------------------------------------------------------------- drawing


@pytest.mark.parametrize("seed", range(4))
def test_sample_with_noise_equals_multinomial(seed):
    seqs = make_seqs(200 + seed, 16)
    logits = make_logits(seqs, 200 + seed)
    probs = batch_probs(seqs, logits)
    for gen_seed in (0, 7, 123456789):
        g = torch.Generator().manual_seed(gen_seed)
        noise = torch.empty(probs.shape).exponential_(1, generator=g)
        g2 = torch.Generator().manual_seed(gen_seed)
        want = torch.multinomial(probs, 1, generator=g2).squeeze(1)
        assert torch.equal(sample_with_noise(probs, noise), want)
        g3 = torch.Generator().manual_seed(gen_seed)
        assert torch.equal(sample(probs, g3), want)


def test_per_sequence_noise_equals_per_sequence_multinomial():
    """The runner draws noise per sequence (its own generator) and concatenates; each sequence's
    tokens equal a multinomial draw on its own rows with its own generator."""
    seqs = make_seqs(300, 12)
    logits = make_logits(seqs, 300)
    probs = batch_probs(seqs, logits)
    seeds = [1000 + i for i in range(len(seqs))]
    noise = torch.cat(
        [
            torch.empty(s.rows, VOCAB).exponential_(1, generator=torch.Generator().manual_seed(sd))
            for s, sd in zip(seqs, seeds, strict=True)
        ]
    )
    tokens = torch.split(sample_with_noise(probs, noise), [s.rows for s in seqs])
    for s, lg, sd, t in zip(seqs, logits, seeds, tokens, strict=True):
        want = torch.multinomial(single_probs(s, lg), 1, generator=torch.Generator().manual_seed(sd)).squeeze(1)
        assert torch.equal(t, want)
        if s.blocks_eos:
            assert (t != EOS).all()


def test_sampled_tokens_respect_filters():
    seqs = make_seqs(400, 16)
    logits = make_logits(seqs, 400)
    probs = batch_probs(seqs, logits)
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        t = sample_with_noise(probs, torch.empty(probs.shape).exponential_(1, generator=g))
        assert (probs.gather(1, t[:, None]) > 0).all()


# ---------------------------------------------------------------- top_p = 1.0


def test_top_p_one_applies_the_filter_like_the_reference():
    """top_p = 1.0 still runs the nucleus filter (the reference's TopPLogitsWarper is always on): tokens
    whose probability underflows to 0 are dropped before EOS is blocked. Both paths agree."""
    lg = torch.linspace(0, 10, VOCAB)[None].clone()
    lg[0, EOS] = 200.0  # EOS dominates so much that every other probability underflows ...
    s = FakeSeq(1, (1.0,), 1.0, 0, 1.0, 10, torch.zeros(1, 0, dtype=torch.long))  # ... but is blocked
    assert s.blocks_eos
    single, batched = single_probs(s, lg), batch_probs([s], [lg])
    assert torch.equal(batched, single)
    assert int((single > 0).sum()) == 2  # min_keep 3, minus the blocked EOS
    unblocked = FakeSeq(1, (1.0,), 1.0, 0, 1.0, 0, torch.zeros(1, 0, dtype=torch.long))
    assert torch.equal(batch_probs([unblocked], [lg]), single_probs(unblocked, lg))
