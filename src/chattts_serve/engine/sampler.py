"""Batched sampling, in exactly the reference's order::

    logits / temperature -> repetition penalty (last 16 generated) -> top-p (keep >= 3) -> top-k
    -> EOS blocked while fewer than min_new_tokens -> softmax -> multinomial

One call samples for many sequences, each with its own parameters: fp32 logits ``[R, V]``, one row per
codebook of a code sequence (row b * 4 + q) and one row per text sequence. The ops mirror the reference's
(HF logits warpers and ChatTTS's repetition penalty) so that fp32 results are bit-identical; the tests check
every row against a single-sequence oracle (tests/engine/sampler_oracle.py).

Top-p then top-k without sorting the vocabulary (CPU): only the k largest logits can survive both filters,
so ``torch.topk`` of the window decides each row's cut, and one mask ``logits >= cut value`` replaces both
filters. The reference's top-p compares a float32 cumulative sum of a float32 softmax over the *sorted*
row, whose rounding depends on the sort, so the window estimates that sum in float64 with a proven bound
on the reference's rounding error (``_cum_error``) and only trusts decisions outside it. A row where a
decision falls inside the bound, the cut splits equal logits, or a value is not finite takes the full
sort (``_filter_sorted``, the reference's ops), as do rows with top-k off, small batches and non-CPU
devices. Every row thus gets the reference's mask bit for bit; the final softmax and the draw run over
the full row as before, so the random stream is untouched.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PENALTY_WINDOW = 16
MIN_TOKENS_TO_KEEP = 3
_U = 2.0**-24  # float32 unit roundoff
_TINY = 2.0**-126  # smallest normal float32
_WINDOW_MIN_ELEMENTS = 8192  # measured crossover on 2 Zen 4 cores: ~10 rows of 626 logits
_ZERO_BELOW = -110.0  # exp(x) for x below this is 0 in float32 (the smallest subnormal is exp(-103.3))


def batched_probs(
    logits: torch.Tensor,  # [R, V] fp32
    history: torch.Tensor,  # [R, W] int64: the last W generated ids per row (W <= 16), padded anywhere
    history_valid: torch.Tensor,  # [R, W] bool
    temperature: torch.Tensor,  # [R, 1] fp32
    penalty: torch.Tensor,  # [R, 1] fp32 (1.0 = off)
    top_p: torch.Tensor,  # [R, 1] fp64 (1.0 = off)
    top_k: torch.Tensor,  # [R] int64 (0 = off)
    k_max: int,  # max over rows of the effective k (computed on the host: no device sync here)
    block_eos: torch.Tensor | None,  # [R] bool, or None when no row blocks EOS
    eos_id: int,
    host_reads: bool | None = None,
) -> torch.Tensor:
    """``host_reads``: may read device values back to take a cheaper branch (default: on the CPU,
    where that costs no sync). Both branches give the same bits; False never reads anything back."""
    if host_reads is None:
        host_reads = logits.device.type == "cpu"
    logits = logits / temperature
    # Penalty 1 everywhere (the refine pass's default) is exactly the identity: 1 ** c = 1, x * 1 = x / 1 = x.
    if not host_reads or not bool((penalty == 1).all()):
        counts = torch.zeros(logits.shape, dtype=torch.int64, device=logits.device)
        counts.scatter_add_(1, history, history_valid.long())
        alpha = torch.pow(penalty, counts)
        logits = torch.where(logits < 0, logits * alpha, logits / alpha)

    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(min=MIN_TOKENS_TO_KEEP, max=vocab), vocab)
    # The reference compares with the Python float (1 - top_p), which lands in fp32.
    threshold = (1 - top_p).to(torch.float32)
    # Both give the same bits. Not on a GPU: the row split would cost a device sync per step, and the
    # sort is cheap there. Not for a few rows: the window's ~40 small ops cost more than a short sort.
    if host_reads and logits.numel() >= _WINDOW_MIN_ELEMENTS:
        logits = _filter_windowed(logits, threshold, k)
    else:
        logits = _filter_sorted(logits, threshold, k, k_max)

    if block_eos is not None:
        logits[:, eos_id] = torch.where(block_eos, -float("inf"), logits[:, eos_id])
    return F.softmax(logits, dim=-1)


def _filter_sorted(logits: torch.Tensor, threshold: torch.Tensor, k: torch.Tensor, k_max: int) -> torch.Tensor:
    """Top-p then top-k with the reference's own ops: a full sort of every row."""
    sorted_logits, sorted_idx = torch.sort(logits, descending=False)
    cum_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cum_probs <= threshold
    remove_sorted[..., -MIN_TOKENS_TO_KEEP:].fill_(False)  # (a Python value assigned would build a tensor)
    logits = logits.masked_fill(remove_sorted.scatter(1, sorted_idx, remove_sorted), -float("inf"))
    kth = torch.topk(logits, k_max)[0].gather(1, (k - 1)[:, None])
    return logits.masked_fill(logits < kth, -float("inf"))


def _filter_windowed(logits: torch.Tensor, threshold: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The same mask as ``_filter_sorted`` from the k + 1 largest logits of each row (see the module
    docstring); rows it cannot decide exactly go through ``_filter_sorted``."""
    vocab = logits.shape[-1]
    windowed = k < vocab  # top-k off (k = V): nothing to gain
    if not bool(windowed.any()):
        return _filter_sorted(logits, threshold, k, vocab)
    width = int(k[windowed].max()) + 1  # k + 1: the value after the cut tells a tie at the cut
    cut, exact = _window_cut(logits, threshold, k.clamp(max=width - 1), width)
    out = logits.masked_fill(logits < cut, -float("inf"))
    slow = (~(exact & windowed)).nonzero().squeeze(1)
    if len(slow):
        ks = k[slow]
        out[slow] = _filter_sorted(logits[slow], threshold[slow], ks, int(ks.max()))
    return out


def _window_cut(
    logits: torch.Tensor, threshold: torch.Tensor, k: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the smallest logit both filters keep ``[R, 1]``, and whether that is certain ``[R]``.

    The reference keeps the sorted position d (0 = largest) when d < 3 or when the float32 cumulative
    softmax mass of positions d, d + 1, ... (its ascending cumsum) is above the threshold: a prefix of the
    positions, M long; top-k then keeps the logits >= the k-th largest that survived. So the cut is
    position min(M, k) - 1, and it needs only the masses ``tail[d]`` for d < k."""
    vals = torch.topk(logits, width).values  # [R, width], descending
    top, last = vals[:, :1], vals[:, -1:]
    # Mass below the window: every logit < its last value (float32 exp, as the reference's), plus that
    # value's copies outside the window.
    e = torch.exp((logits - top).masked_fill(logits >= last, -float("inf")))
    copies_out = (logits == last).sum(1, keepdim=True) - (vals == last).sum(1, keepdim=True)
    xw = vals.double() - top.double()  # a difference of two floats: exact, or within 2^-53
    ew = torch.exp(xw)
    below = e.double().sum(1, keepdim=True) + copies_out * ew[:, -1:]
    tail = (below + ew.flip(1).cumsum(1).flip(1)) / (below + ew.sum(1, keepdim=True))  # [R, width]

    # The reference's float32 tail lies within tail * (1 +- rel) +- abs of this one (see _cum_error).
    rel, abs_ = _cum_error(logits.shape[-1])
    thr = threshold.double()
    hi = tail * (1 + rel) + abs_
    lo = tail * (1 - rel) - abs_
    zero = xw < _ZERO_BELOW  # this and every smaller logit get probability exactly 0: the sum is 0
    removed = torch.where(zero, thr >= 0, hi <= thr)
    kept = torch.where(zero, thr < 0, lo > thr + thr.abs() * 2 * _U + 2.0**-149)  # beyond thr's half ulp
    pos = torch.arange(width, device=logits.device)
    kept |= pos < MIN_TOKENS_TO_KEEP
    removed &= pos >= MIN_TOKENS_TO_KEEP
    decides = pos < k[:, None]  # positions >= k cannot change the cut
    certain = ((kept | removed) | ~decides).all(1)
    m = (kept & decides).sum(1, keepdim=True)  # kept is a prefix: M, capped at k
    cut = vals.gather(1, m - 1)
    after = vals.gather(1, m)  # k < width, so position m exists
    certain &= (cut != after).squeeze(1) & torch.isfinite(vals).all(1)
    return cut, certain


def _cum_error(vocab: int) -> tuple[float, float]:
    """Bound on |reference tail - exact tail|: relative and absolute parts.

    The reference computes, over the sorted row, e_i = exp(fl(x_i)) (x_i = logit - max, rounded once:
    relative error <= 110 u on e_i for x_i >= -110; a vectorised exp adds <= 4 ulp = 8 u), S = sum e_i in
    some order (any order: <= (V - 1) u relative, to first order), p_i = e_i * (1 / S) (2 roundings),
    then a cumulative sum (float32 accumulation assumed: <= V u more) rounded to float32 (u). First-order
    total (2 V + 130) u, with 1 % for the second-order terms. Absolute: a subnormal or flushed e_i or p_i
    is off by < 2^-126 each. The estimate here takes the e_i below the window in float32 too (<= 120 u,
    or 2^-126 absolute, each) and the rest in float64 (1e-12)."""
    rel = 1.01 * (2 * vocab + 250) * _U + 1e-12
    return rel, 3 * vocab * _TINY


def sample_with_noise(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """argmax(p / E), E ~ Exp(1): exactly what ``torch.multinomial(p, 1, generator)`` computes for one
    draw when E was drawn from that generator with ``exponential_`` on a tensor of p's shape."""
    return (probs / noise).argmax(dim=-1)


def effective_top_k(top_k: int, vocab: int) -> int:
    """The k a row uses: top_k clamped to [3, vocab], or vocab when top_k is 0 (off)."""
    return min(max(top_k, MIN_TOKENS_TO_KEEP), vocab) if top_k > 0 else vocab
