"""What one KV slot costs on the device, by part, in the dtypes the engine will use: the one rule behind
auto slots, a fixed slot count's fitted length (and its refusal), and a replica's memory budget.

A slot holds its keys and values for ``max_len`` positions and the static step's scratch position
(``KVCache.bytes_per_slot`` in the cache's dtype: fp32 is 283 MB at 2304 positions, bf16 half, int8 with
its fp32 scale per vector 75 MB), its
audio stream's hidden-state row and that row's share of the store's headroom
(``HiddenStore.bytes_per_slot``), and, on CUDA, its row's share of the step graphs' memory pool: the
pool is as large as the largest bucket's live activations, and the largest bucket has a row per slot.
``graph_bytes_per_row`` bounds that share from above (what one decode row can hold live at once:
attention scores over the whole context, the text head's logits and its top-p sort); ``scripts/gpu_check.py``
compares it with the capture's measured bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.chattts.config import GPTConfig
from ..models.chattts.gpt import KVCache
from .hidden_store import HiddenStore

SCRATCH_POSITIONS = 1
"""Positions past ``max_len`` the static decode step's cache has (``runner``: a padded row writes there)."""

MB = 10**6


def graph_bytes_per_row(cfg: GPTConfig, max_len: int) -> int:
    """An upper bound on one decode row's share of the step graphs' pool: fp32 attention scores and
    probabilities over the whole context, the layer's activations (hidden and MLP), and the text head's
    logits, probabilities, noise and sorted copy with their int64 indices (a code row's heads are smaller)."""
    floats = 2 * cfg.num_heads * max_len + 4 * cfg.hidden_size + 2 * cfg.intermediate_size
    floats += 4 * cfg.num_text_tokens
    return 4 * floats + 8 * cfg.num_text_tokens


@dataclass(frozen=True, slots=True)
class SlotCost:
    kv: int
    """Keys and values, all layers, ``max_len`` positions and the scratch one, in ``kv_dtype`` (int8: and their
    scales)."""
    hidden: int
    """The audio stream's hidden-state row (fp32) and its share of the store's headroom."""
    graphs: int
    """The slot's row in the step graphs' pool (0 without CUDA graphs)."""
    kv_dtype: torch.dtype

    @property
    def total(self) -> int:
        return self.kv + self.hidden + self.graphs

    def describe(self) -> str:
        dtype = str(self.kv_dtype).removeprefix("torch.") + (" (+ fp32 scales)" if self.kv_dtype == torch.int8 else "")
        return (
            f"{self.total / MB:.0f} MB a slot: {dtype} keys and values {self.kv / MB:.0f} MB, hidden-state row "
            f"{self.hidden / MB:.1f} MB, graph activations {self.graphs / MB:.1f} MB"
        )


def slot_cost(cfg: GPTConfig, max_len: int, kv_dtype: torch.dtype, graphs: bool) -> SlotCost:
    """One slot of ``max_len`` positions with its cache in ``kv_dtype``; ``graphs``: the step graphs'
    pool counts (CUDA)."""
    return SlotCost(
        KVCache.bytes_per_slot(cfg, max_len + SCRATCH_POSITIONS, kv_dtype),
        HiddenStore.bytes_per_slot(cfg.hidden_size, max_len),
        graph_bytes_per_row(cfg, max_len) if graphs else 0,
        kv_dtype,
    )


def check_slots_fit(num_slots: int, cost: SlotCost, budget: int, max_len: int) -> None:
    """Refuse (ValueError) ``num_slots`` fixed slots that do not fit ``budget`` bytes even at ``max_len``
    positions (the shortest a slot is fitted to): the engine would run out of memory allocating them."""
    need = num_slots * cost.total
    if need > budget:
        fit = max(0, budget // cost.total)
        raise ValueError(
            f"{num_slots} KV slots of {max_len} positions need {need / 1e9:.1f} GB ({cost.describe()}) but the "
            f"cache may take {budget / 1e9:.1f} GB of this device: set --max-num-seqs {fit} or fewer"
            f"{' or --kv-cache-dtype bf16' if cost.kv_dtype == torch.float32 else ''}, or leave the slots to auto"
        )
