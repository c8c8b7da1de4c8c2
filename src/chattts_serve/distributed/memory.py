"""A replica's share of a CUDA device: ``max_memory_fraction`` caps what its allocator may take
(``torch.cuda.set_per_process_memory_fraction``), and its KV slots are sized to fit inside that cap, so
several replicas (or tenants) can share a card and one of them cannot take it down."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

from ..engine.config import EngineConfig

logger = logging.getLogger(__name__)

ACTIVATION_RESERVE = 0.25
"""Share of the capped budget kept for activations, the audio decoders and CUDA graphs (not KV)."""


@dataclass(frozen=True, slots=True)
class MemoryBudget:
    total_bytes: int
    """The device's memory."""
    fraction: float
    """Share of it this process may allocate."""
    weights_bytes: int
    """The model's weights as loaded."""
    kv_bytes_per_slot: int

    def __post_init__(self) -> None:
        if not 0 < self.fraction <= 1:
            raise ValueError(f"max_memory_fraction must be in (0, 1], got {self.fraction!r}")

    @property
    def cap_bytes(self) -> int:
        return int(self.total_bytes * self.fraction)

    def num_slots(self, max_slots: int, reserve: float = ACTIVATION_RESERVE) -> int:
        """KV slots that fit in the cap once the weights and the reserve are set aside, at most
        ``max_slots``. Raises ValueError when not even one fits (the replica could not serve)."""
        free = self.cap_bytes * (1 - reserve) - self.weights_bytes
        fit = int(free // self.kv_bytes_per_slot) if free > 0 else 0
        if fit < 1:
            raise ValueError(
                f"max_memory_fraction {self.fraction:g} of {self.total_bytes / 2**30:.1f} GiB leaves no room for "
                f"one KV slot ({self.kv_bytes_per_slot / 2**20:.0f} MiB) after "
                f"{self.weights_bytes / 2**20:.0f} MiB of weights"
            )
        return min(max_slots, fit)


def weights_bytes(root: Path, precision: str) -> int:
    """The weights' size as loaded: the checkpoint's fp32 files, the GPT trunk at the precision's width."""
    import torch

    from ..model.checkpoint import DECODER, DVAE_FILE, EMBED, GPT_WEIGHTS, VOCOS
    from ..model.quant import parse_precision

    total = sum((root / rel).stat().st_size for rel in (GPT_WEIGHTS, EMBED, DECODER, DVAE_FILE, VOCOS))
    gpt = (root / GPT_WEIGHTS).stat().st_size
    width = torch.empty(0, dtype=parse_precision(precision).trunk_dtype).element_size()
    return total - gpt + gpt * width // 4


def budget_for(model: str, config: EngineConfig, device, fraction: float) -> MemoryBudget:
    """The budget of ``fraction`` of ``device`` for the checkpoint at ``model``, read without loading it."""
    import torch

    from ..engine.runner import kv_bytes_per_slot
    from ..model import checkpoint
    from ..model.quant import parse_precision

    root = checkpoint.resolve(model)
    dims = checkpoint.read_config(root)
    dtype = parse_precision(config.precision).trunk_dtype
    # kv_bytes_per_slot reads only the model's dimensions (model.config.gpt).
    per_slot = kv_bytes_per_slot(SimpleNamespace(config=dims), config.scheduler.max_model_len, dtype)
    total = torch.cuda.get_device_properties(device).total_memory
    return MemoryBudget(total, fraction, weights_bytes(root, config.precision), per_slot)


def cap_device_memory(model: str, config: EngineConfig, device: str, fraction: float | None) -> EngineConfig:
    """On CUDA with a fraction: cap this process's allocator and return ``config`` with the KV slots that
    fit (at most its own ``max_num_seqs``). Elsewhere ``config`` unchanged (a CPU has no such cap)."""
    import torch

    if fraction is None or not device.startswith("cuda") or not torch.cuda.is_available():
        if fraction is not None:
            logger.info("max_memory_fraction applies to CUDA devices only; ignored on %s", device)
        return config
    dev = torch.device(device)
    budget = budget_for(model, config, dev, fraction)
    torch.cuda.set_per_process_memory_fraction(fraction, dev)
    slots = budget.num_slots(config.scheduler.max_num_seqs)
    logger.info("memory cap %.0f MiB (%g of %s): %d KV slots", budget.cap_bytes / 2**20, fraction, device, slots)
    return replace(config, scheduler=replace(config.scheduler, max_num_seqs=slots), auto_slots=False)
