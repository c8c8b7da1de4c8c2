"""engine/sampler.py: the windowed top-p / top-k filter (``_filter_windowed``: ``torch.topk`` of k + 1
logits, no sort) against the full-sort filter (``_filter_sorted``: the reference's ops, the sampler before
the window) bit for bit, on random rows with mixed per-row parameters, ties, non-finite values and
thresholds that land exactly on the reference's cumulative sums. test_batched_sampler.py checks the whole
``batched_probs`` (windowed on CPU) against the single-sequence oracle."""

from __future__ import annotations

import random

import pytest
import torch

from chattts_serve.engine.sampler import (
    MIN_TOKENS_TO_KEEP,
    _filter_sorted,
    _filter_windowed,
    _window_cut,
    effective_top_k,
)

CODE_VOCAB = 626
TEXT_VOCAB = 21178
TOP_P = [1.0, 0.999, 0.99, 0.95, 0.7, 0.5, 0.3, 0.01, 0.0]


def ks(top_k: list[int], vocab: int) -> torch.Tensor:
    """Effective k per row, as ``batched_probs`` computes it."""
    return torch.tensor([effective_top_k(t, vocab) for t in top_k])


def random_rows(seed: int, rows: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits of every sharpness (flat to one-hot), some rows with ties, steps of 0.5 or infinities;
    per-row top_p and top_k, top-k off and k >= V included."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor([rng.choice([0.3, 1.0, 3.0, 8.0, 30.0, 100.0]) for _ in range(rows)])
    logits = torch.randn(rows, vocab, generator=g) * scale[:, None]
    for r in range(rows):
        kind = rng.random()
        if kind < 0.15:  # a run of equal values somewhere in the top 30
            order = logits[r].argsort(descending=True)
            a, n = rng.randint(0, 25), rng.randint(2, 6)
            logits[r, order[a : a + n]] = logits[r, order[a]].item()
        elif kind < 0.25:  # coarse values: ties everywhere
            logits[r] = (logits[r] * 2).round() / 2
        elif kind < 0.3:
            logits[r, rng.sample(range(vocab), 40)] = -float("inf")
    top_p = torch.tensor([rng.choice(TOP_P) for _ in range(rows)], dtype=torch.float64)[:, None]
    top_k = [rng.choice([0, 1, 3, 4, 5, 20, 50, 200, vocab - 1, vocab, vocab + 5]) for _ in range(rows)]
    return logits, (1 - top_p).to(torch.float32), ks(top_k, vocab)


def assert_same_filter(logits: torch.Tensor, threshold: torch.Tensor, k: torch.Tensor):
    want = _filter_sorted(logits, threshold, k, int(k.max()))
    got = _filter_windowed(logits.clone(), threshold, k)
    assert torch.equal(got, want)


@pytest.mark.parametrize("seed", range(40))
def test_windowed_filter_equals_sorted_code_vocab(seed):
    assert_same_filter(*random_rows(seed, 64, CODE_VOCAB))


@pytest.mark.parametrize("seed", range(4))
def test_windowed_filter_equals_sorted_text_vocab(seed):
    assert_same_filter(*random_rows(1000 + seed, 24, TEXT_VOCAB))


def test_windowed_filter_rows_are_independent():
    logits, threshold, k = random_rows(7, 32, CODE_VOCAB)
    full = _filter_windowed(logits.clone(), threshold, k)
    for r in range(32):
        one = _filter_windowed(logits[r : r + 1].clone(), threshold[r : r + 1], k[r : r + 1])
        assert torch.equal(one, full[r : r + 1])


def sorted_cumsum(logits: torch.Tensor) -> torch.Tensor:
    """The reference's float32 cumulative sums, ascending order (as in ``_filter_sorted``)."""
    return torch.sort(logits).values.softmax(-1).cumsum(-1)


@pytest.mark.parametrize("vocab", [CODE_VOCAB, TEXT_VOCAB])
def test_threshold_on_a_cumulative_sum_exactly(vocab):
    """The threshold equal to (or one float from) the reference's own cumsum at a position inside the
    window: the estimate cannot tell, so the row must go to the full sort and still match."""
    rows = 24
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(rows, vocab, generator=g) * 3
    cum = sorted_cumsum(logits)
    k = torch.full((rows,), 20)
    threshold = torch.empty(rows, 1)
    for r in range(rows):
        c = cum[r, vocab - 1 - (MIN_TOKENS_TO_KEEP + r % 15)]  # sorted position 3 .. 17 from the top
        step = [-2.0, 0.0, 2.0][r % 3]  # the float below, the value itself, the float above
        threshold[r, 0] = torch.nextafter(c, torch.tensor(step)) if step else c
    assert_same_filter(logits, threshold, k)
    _, certain = _window_cut(logits, threshold, k, 21)
    assert not certain.any()


def test_top_p_one_with_underflowing_probabilities():
    """threshold 0: the reference drops exactly the tokens whose probability is 0 in float32. Rows with
    the k-th value far below the top (probability exactly 0), near the float32 underflow, and above it."""
    logits = torch.linspace(0, 5, CODE_VOCAB).repeat(6, 1)
    for r, gap in enumerate([500.0, 200.0, 120.0, 100.0, 90.0, 30.0]):
        logits[r, 7] = logits[r].max() + gap
    threshold = torch.zeros(6, 1)
    k = torch.full((6,), 20)
    assert_same_filter(logits, threshold, k)
    _, certain = _window_cut(logits, threshold, k, 21)
    assert certain[[0, 1, 2, 5]].all()  # 0 for sure (x < -110), or clearly above 0


def test_float32_exp_is_zero_below_the_cutoff():
    """``_window_cut`` takes a logit more than 110 below the row's maximum to get probability exactly 0
    (exp underflows: the smallest subnormal is exp(-103.3)). Holds for the vectorised and scalar tails."""
    for n in (1, 7, 16, 33, 626):
        row = torch.cat([torch.zeros(1), torch.full((n,), -110.0), torch.full((n,), -1e4)])
        assert (torch.exp(row[1:]) == 0).all()
        assert (row.softmax(-1)[1:] == 0).all()
        assert (torch.sort(row).values.softmax(-1).cumsum(-1)[:-1] == 0).all()


@pytest.mark.parametrize(
    ("vocab", "temperature", "floor"),
    [(CODE_VOCAB, 0.3, 0.97), (CODE_VOCAB, 1.0, 0.97), (TEXT_VOCAB, 0.7, 0.8)],
)
def test_most_rows_skip_the_sort(vocab, temperature, floor):
    """The window decides nearly every row with the default top_p 0.7 / top_k 20 (the rest sort): the
    error bound is not so wide that the fast path never runs."""
    rows = 256
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(rows, vocab, generator=g) * 4 / temperature
    threshold = torch.full((rows, 1), 0.3)
    _, certain = _window_cut(logits, threshold, torch.full((rows,), 20), 21)
    assert certain.float().mean() >= floor
