"""sampler_oracle.py (the single-sequence sampler the batched one is tested against): every pure function against
a plain numpy / python-loop reference, with the window and min-keep constants of engine/sampler.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from chattts_serve.engine.sampler import MIN_TOKENS_TO_KEEP, PENALTY_WINDOW

from .sampler_oracle import (
    apply_repetition_penalty,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    block_eos,
    process_logits,
    sample,
)

NEG_INF = -np.inf


def random_logits(rows: int, vocab: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * scale


# ---------------------------------------------------------------- references


def ref_temperature(logits: np.ndarray, temps: np.ndarray) -> np.ndarray:
    out = logits.astype(np.float64).copy()
    for r in range(out.shape[0]):
        out[r] = out[r] / temps[r]
    return out


def ref_repetition_penalty(logits: np.ndarray, history: np.ndarray, penalty: float) -> np.ndarray:
    out = logits.astype(np.float64).copy()
    for r in range(out.shape[0]):
        window = list(history[r])[-16:]
        for tok in set(window):
            c = window.count(tok)
            alpha = penalty**c
            out[r, tok] = out[r, tok] * alpha if out[r, tok] < 0 else out[r, tok] / alpha
    return out


def ref_top_p(logits: np.ndarray, top_p: float, min_keep: int = 3) -> np.ndarray:
    out = logits.astype(np.float64).copy()
    if top_p >= 1.0:
        return out
    for r in range(out.shape[0]):
        row = out[r]
        order = np.argsort(row, kind="stable")  # ascending
        srt = row[order]
        finite = np.isfinite(srt)
        p = np.zeros_like(srt)
        p[finite] = np.exp(srt[finite] - srt[finite].max())
        p /= p.sum()
        cum = np.cumsum(p)
        remove = cum <= 1 - top_p
        remove[-min_keep:] = False
        for pos, idx in enumerate(order):
            if remove[pos]:
                row[idx] = NEG_INF
    return out


def ref_top_k(logits: np.ndarray, top_k: int, min_keep: int = 3) -> np.ndarray:
    out = logits.astype(np.float64).copy()
    if top_k <= 0:
        return out
    k = min(max(top_k, min_keep), out.shape[1])
    for r in range(out.shape[0]):
        kth = sorted(out[r], reverse=True)[k - 1]
        for i in range(out.shape[1]):
            if out[r, i] < kth:
                out[r, i] = NEG_INF
    return out


def ref_softmax(logits: np.ndarray) -> np.ndarray:
    out = np.zeros_like(logits, dtype=np.float64)
    for r in range(logits.shape[0]):
        row = logits[r]
        e = np.where(np.isfinite(row), np.exp(row - row[np.isfinite(row)].max()), 0.0)
        out[r] = e / e.sum()
    return out


def assert_same_logits(actual: torch.Tensor, expected: np.ndarray, rtol: float = 1e-6, atol: float = 1e-6):
    a = actual.double().numpy()
    assert a.shape == expected.shape
    np.testing.assert_array_equal(np.isneginf(a), np.isneginf(expected))
    fin = np.isfinite(expected)
    np.testing.assert_allclose(a[fin], expected[fin], rtol=rtol, atol=atol)


# ---------------------------------------------------------------- temperature


@pytest.mark.parametrize("seed", [0, 1])
def test_temperature_per_row(seed):
    logits = random_logits(5, 40, seed)
    temps = np.array([0.1, 0.3, 1.0, 1.7, 4.0], dtype=np.float32)
    out = apply_temperature(logits, torch.from_numpy(temps).view(-1, 1))
    assert_same_logits(out, ref_temperature(logits.numpy(), temps))


def test_temperature_broadcast_scalar():
    logits = random_logits(3, 10, 2)
    out = apply_temperature(logits, torch.tensor([[0.5]]))
    assert_same_logits(out, ref_temperature(logits.numpy(), np.full(3, 0.5)))


# ---------------------------------------------------------------- repetition penalty


@pytest.mark.parametrize("penalty", [1.05, 1.5, 0.8])
@pytest.mark.parametrize("hist_len", [0, 1, 7, 16, 40])
def test_repetition_penalty_matches_reference(penalty, hist_len):
    vocab = 12  # small vocab: many repeats, so counts > 1 occur
    logits = random_logits(4, vocab, 3 + hist_len)
    g = torch.Generator().manual_seed(hist_len)
    history = torch.randint(0, vocab, (4, hist_len), generator=g)
    out = apply_repetition_penalty(logits, history, penalty)
    expected = ref_repetition_penalty(logits.numpy(), history.numpy(), penalty)
    assert_same_logits(out, expected, rtol=1e-5)


def test_repetition_penalty_only_last_16_count():
    assert PENALTY_WINDOW == 16
    logits = torch.tensor([[2.0, -2.0, 1.0, 3.0]])
    # token 0 appears only outside the window; token 1 three times inside, token 3 once inside.
    history = torch.tensor([[0] * 10 + [1, 1, 1, 3] + [2] * 12])
    out = apply_repetition_penalty(logits, history, 2.0)
    # window = [1, 1, 1, 3, 2 * 12]: token 2 counted 12 times
    expected = torch.tensor([[2.0, -2.0 * 8, 1.0 / 2**12, 3.0 / 2]])
    torch.testing.assert_close(out, expected)


def test_repetition_penalty_sign_rule():
    logits = torch.tensor([[-1.0, 0.0, 1.0, 5.0]])
    history = torch.tensor([[0, 1, 2]])
    out = apply_repetition_penalty(logits, history, 1.25)
    # negative: multiplied; zero and positive: divided
    torch.testing.assert_close(out, torch.tensor([[-1.25, 0.0, 0.8, 5.0]]))


def test_repetition_penalty_one_is_identity():
    logits = random_logits(4, 30, 5)
    history = torch.randint(0, 30, (4, 20))
    out = apply_repetition_penalty(logits, history, 1.0)
    torch.testing.assert_close(out, logits, rtol=0, atol=0)


def test_repetition_penalty_does_not_mutate_input():
    logits = random_logits(2, 10, 6)
    before = logits.clone()
    apply_repetition_penalty(logits, torch.tensor([[1, 2], [3, 3]]), 1.3)
    torch.testing.assert_close(logits, before, rtol=0, atol=0)


# ---------------------------------------------------------------- top-p


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.7, 0.9, 0.999])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_top_p_matches_reference(top_p, seed):
    logits = random_logits(6, 50, 10 + seed)
    out = apply_top_p(logits, top_p)
    assert_same_logits(out, ref_top_p(logits.numpy(), top_p))
    # kept values are untouched
    kept = torch.isfinite(out)
    torch.testing.assert_close(out[kept], logits[kept], rtol=0, atol=0)


def test_top_p_keeps_at_least_three():
    assert MIN_TOKENS_TO_KEEP == 3
    logits = torch.tensor([[20.0, 0.0, -1.0, -2.0, -3.0, 1.0]])  # one token holds ~all the mass
    out = apply_top_p(logits, 0.1)
    assert torch.isfinite(out).sum().item() == 3
    assert torch.isfinite(out[0, [0, 5, 1]]).all()


def test_top_p_one_is_identity():
    logits = random_logits(3, 20, 4)
    torch.testing.assert_close(apply_top_p(logits, 1.0), logits, rtol=0, atol=0)


def test_top_p_exact_threshold_drops_tail():
    # probabilities 0.1, 0.2, 0.3, 0.4 (ascending) with min_keep=1: cum = .1 .3 .6 1.0
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4]], dtype=torch.float64)
    logits = p.log().float()
    out = apply_top_p(logits, 0.75, min_keep=1)  # drop cum <= 0.25 -> only the 0.1 token
    assert torch.isneginf(out).tolist() == [[True, False, False, False]]


# ---------------------------------------------------------------- top-k


@pytest.mark.parametrize("top_k", [1, 2, 3, 5, 20, 100])
def test_top_k_matches_reference(top_k):
    logits = random_logits(5, 40, 20 + top_k)
    out = apply_top_k(logits, top_k)
    expected = ref_top_k(logits.numpy(), top_k)
    assert_same_logits(out, expected)
    assert (torch.isfinite(out).sum(-1) == min(max(top_k, 3), 40)).all()


def test_top_k_keeps_ties_at_kth_value():
    logits = torch.tensor([[5.0, 4.0, 3.0, 3.0, 3.0, 1.0, 0.0]])
    out = apply_top_k(logits, 3)
    assert torch.isfinite(out).tolist() == [[True, True, True, True, True, False, False]]
    assert_same_logits(out, ref_top_k(logits.numpy(), 3))


def test_top_k_zero_disables():
    logits = random_logits(2, 10, 7)
    torch.testing.assert_close(apply_top_k(logits, 0), logits, rtol=0, atol=0)


def test_top_k_larger_than_vocab_keeps_all():
    logits = random_logits(2, 5, 8)
    torch.testing.assert_close(apply_top_k(logits, 50), logits, rtol=0, atol=0)


# ---------------------------------------------------------------- EOS


def test_block_eos_only_touches_eos_and_copies():
    logits = random_logits(4, 626, 9)
    before = logits.clone()
    out = block_eos(logits, 625)
    assert torch.isneginf(out[:, 625]).all()
    torch.testing.assert_close(out[:, :625], before[:, :625], rtol=0, atol=0)
    torch.testing.assert_close(logits, before, rtol=0, atol=0)  # input untouched


# ---------------------------------------------------------------- the whole chain


def ref_process(logits, history, temps, penalty, top_p, top_k, eos):
    x = ref_temperature(logits, temps)
    x = ref_repetition_penalty(x, history, penalty)
    x = ref_top_p(x, top_p)
    x = ref_top_k(x, top_k)
    if eos is not None:
        x[:, eos] = NEG_INF
    return ref_softmax(x)


@pytest.mark.parametrize(
    "temps,penalty,top_p,top_k,eos",
    [
        ([0.3, 0.3, 0.3, 0.3], 1.05, 0.7, 20, None),
        ([0.3, 0.5, 0.7, 1.0], 1.05, 0.7, 20, 29),
        ([1.0, 1.0, 1.0, 1.0], 1.0, 1.0, 0, None),
        ([0.7, 0.7, 0.7, 0.7], 1.3, 0.5, 4, 0),
        ([2.0, 0.1, 1.0, 0.5], 1.2, 0.95, 2, 3),
    ],
)
def test_process_logits_matches_reference_chain(temps, penalty, top_p, top_k, eos):
    vocab = 30
    logits = random_logits(4, vocab, int(penalty * 100) + top_k)
    history = torch.randint(0, vocab, (4, 25), generator=torch.Generator().manual_seed(top_k))
    temps_np = np.array(temps, dtype=np.float32)
    probs = process_logits(
        logits,
        history,
        temperature=torch.from_numpy(temps_np).view(-1, 1),
        repetition_penalty=penalty,
        top_p=top_p,
        top_k=top_k,
        block_eos_id=eos,
    )
    expected = ref_process(logits.numpy(), history.numpy(), temps_np, penalty, top_p, top_k, eos)
    np.testing.assert_array_equal(probs.numpy() == 0, expected == 0)
    np.testing.assert_allclose(probs.double().numpy(), expected, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(probs.sum(-1), torch.ones(4))


def test_process_logits_temperature_before_top_p():
    """Order matters: temperature sharpens the distribution before the nucleus is cut."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0]])
    kw = dict(repetition_penalty=1.0, top_p=0.7, top_k=0, block_eos_id=None)
    hot = process_logits(logits, torch.zeros(1, 0, dtype=torch.long), temperature=torch.tensor([[5.0]]), **kw)
    cold = process_logits(logits, torch.zeros(1, 0, dtype=torch.long), temperature=torch.tensor([[0.2]]), **kw)
    assert (hot > 0).sum() > (cold > 0).sum() == 3


# ---------------------------------------------------------------- sampling


def test_sample_seeded_is_reproducible():
    probs = torch.softmax(random_logits(8, 100, 11, scale=1.0), -1)
    a = sample(probs, torch.Generator().manual_seed(123))
    b = sample(probs, torch.Generator().manual_seed(123))
    assert a.dtype == torch.int64 and a.shape == (8,)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    draws = {tuple(sample(probs, torch.Generator().manual_seed(s)).tolist()) for s in range(5)}
    assert len(draws) > 1


def test_sample_only_returns_supported_ids():
    logits = random_logits(6, 200, 12)
    probs = process_logits(
        logits,
        torch.zeros(6, 0, dtype=torch.long),
        temperature=torch.ones(6, 1),
        repetition_penalty=1.0,
        top_p=0.7,
        top_k=5,
        block_eos_id=None,
    )
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        ids = sample(probs, gen)
        assert (probs.gather(1, ids[:, None]) > 0).all()
