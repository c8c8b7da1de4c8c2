"""The single-sequence sampler: the oracle the batched sampler (``engine/sampler.py``) is tested against.

One small pure function per step, in exactly the reference's order::

    logits / temperature -> repetition penalty (last 16 generated) -> top-p (keep >= 3) -> top-k
    -> EOS blocked while fewer than min_new_tokens -> softmax -> multinomial

Every function takes fp32 logits ``[R, V]`` (one row per sequence, or per codebook of a sequence: row b * 4 + q
for audio) and returns new logits. The ops mirror the reference's (HF logits warpers and ChatTTS's repetition
penalty), so fp32 results are bit-identical; test_sampler.py checks each one against a numpy reference, and
test_batched_sampler.py checks that the batched path gives these rows bit for bit. The package never runs
them: they live here so the serving code holds one sampler only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from chattts_serve.engine.sampler import MIN_TOKENS_TO_KEEP, PENALTY_WINDOW


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """temperature: [R, 1] (or broadcastable) fp32."""
    return logits / temperature


def apply_repetition_penalty(logits: torch.Tensor, history: torch.Tensor, penalty: float) -> torch.Tensor:
    """history [R, t] int64: each row's generated ids so far (prompt excluded). Logits of ids seen c times
    in the last 16 are multiplied (if < 0) or divided (if >= 0) by penalty**c."""
    if penalty == 1.0:
        return logits
    if history.shape[1] > PENALTY_WINDOW:
        history = history[:, -PENALTY_WINDOW:]
    counts = torch.zeros(logits.shape, dtype=torch.int64, device=logits.device)
    counts.scatter_add_(1, history, torch.ones_like(history))
    alpha = torch.pow(penalty, counts)
    return torch.where(logits < 0, logits * alpha, logits / alpha)


def apply_top_p(logits: torch.Tensor, top_p: float, min_keep: int = MIN_TOKENS_TO_KEEP) -> torch.Tensor:
    """Nucleus filter (HF TopPLogitsWarper): drop the low tail whose total probability is <= 1 - top_p.
    Applied at top_p = 1.0 too, as the reference does (it then drops tokens whose probability is 0)."""
    sorted_logits, sorted_idx = torch.sort(logits, descending=False)
    cum_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cum_probs <= (1 - top_p)
    remove_sorted[..., -min_keep:] = False
    remove = remove_sorted.scatter(1, sorted_idx, remove_sorted)
    return logits.masked_fill(remove, -float("inf"))


def apply_top_k(logits: torch.Tensor, top_k: int, min_keep: int = MIN_TOKENS_TO_KEEP) -> torch.Tensor:
    """Keep the k largest (ties at the k-th value kept), k = max(top_k, min_keep) (HF TopKLogitsWarper)."""
    if top_k <= 0:
        return logits
    k = min(max(top_k, min_keep), logits.shape[-1])
    kth = torch.topk(logits, k)[0][..., -1, None]
    return logits.masked_fill(logits < kth, -float("inf"))


def block_eos(logits: torch.Tensor, eos_id: int) -> torch.Tensor:
    logits = logits.clone()
    logits[:, eos_id] = -float("inf")
    return logits


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row: [R, V] -> [R] int64."""
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)


def process_logits(
    logits: torch.Tensor,
    history: torch.Tensor,
    *,
    temperature: torch.Tensor,
    repetition_penalty: float,
    top_p: float,
    top_k: int,
    block_eos_id: int | None,
) -> torch.Tensor:
    """All filters in the reference order; returns probabilities [R, V]."""
    logits = apply_temperature(logits, temperature)
    logits = apply_repetition_penalty(logits, history, repetition_penalty)
    logits = apply_top_p(logits, top_p)
    logits = apply_top_k(logits, top_k)
    if block_eos_id is not None:
        logits = block_eos(logits, block_eos_id)
    return F.softmax(logits, dim=-1)
