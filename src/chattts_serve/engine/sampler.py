"""Batched sampling, in exactly the reference's order::

    logits / temperature -> repetition penalty (last 16 generated) -> top-p (keep >= 3) -> top-k
    -> EOS blocked while fewer than min_new_tokens -> softmax -> multinomial

One call samples for many sequences, each with its own parameters: fp32 logits ``[R, V]``, one row per
codebook of a code sequence (row b * 4 + q) and one row per text sequence. The ops mirror the reference's
(HF logits warpers and ChatTTS's repetition penalty) so that fp32 results are bit-identical; the tests check
every row against a single-sequence oracle (tests/engine/sampler_oracle.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PENALTY_WINDOW = 16
MIN_TOKENS_TO_KEEP = 3


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
) -> torch.Tensor:
    logits = logits / temperature
    counts = torch.zeros(logits.shape, dtype=torch.int64, device=logits.device)
    counts.scatter_add_(1, history, history_valid.long())
    alpha = torch.pow(penalty, counts)
    logits = torch.where(logits < 0, logits * alpha, logits / alpha)

    sorted_logits, sorted_idx = torch.sort(logits, descending=False)
    cum_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    # The reference compares with the Python float (1 - top_p), which lands in fp32.
    remove_sorted = cum_probs <= (1 - top_p).to(torch.float32)
    remove_sorted[..., -MIN_TOKENS_TO_KEEP:] = False
    logits = logits.masked_fill(remove_sorted.scatter(1, sorted_idx, remove_sorted), -float("inf"))

    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(min=MIN_TOKENS_TO_KEEP, max=vocab), vocab)
    kth = torch.topk(logits, k_max)[0].gather(1, (k - 1)[:, None])
    logits = logits.masked_fill(logits < kth, -float("inf"))

    if block_eos is not None:
        logits[:, eos_id] = torch.where(block_eos, -float("inf"), logits[:, eos_id])
    return F.softmax(logits, dim=-1)


def sample_with_noise(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """argmax(p / E), E ~ Exp(1): exactly what ``torch.multinomial(p, 1, generator)`` computes for one
    draw when E was drawn from that generator with ``exponential_`` on a tensor of p's shape."""
    return (probs / noise).argmax(dim=-1)


def effective_top_k(top_k: int, vocab: int) -> int:
    """The k a row uses: top_k clamped to [3, vocab], or vocab when top_k is 0 (off)."""
    return min(max(top_k, MIN_TOKENS_TO_KEEP), vocab) if top_k > 0 else vocab
