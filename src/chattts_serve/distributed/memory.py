"""A replica's share of a CUDA device: ``max_memory_fraction`` caps what its allocator may take
(``torch.cuda.set_per_process_memory_fraction``), and its KV slots are sized to fit inside that cap, so
several replicas (or tenants) can share a card and one of them cannot take it down.

The allocator cap is the share less ``CUDA_CONTEXT_RESERVE``: memory the process holds outside torch's
allocator, which the cap does not see. Replica fractions that add up to 1.0 then leave each context
its room instead of running the card out of memory."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

from ..engine.config import EngineConfig

logger = logging.getLogger(__name__)

ACTIVATION_RESERVE = 0.25
"""Share of the capped budget kept for activations, the audio decoders and CUDA graphs (not KV); the
audio decode batch is bounded by bytes (``audio.decode.AUDIO_BATCH_BYTES``) to stay inside it."""

CUDA_CONTEXT_RESERVE = 1 << 30
"""Bytes of a replica's share kept outside the allocator cap (1 GiB): the CUDA context and its loaded
kernel images (~0.3-0.6 GiB on Hopper with lazy module loading), library handles (cuBLAS, cuBLASLt)
and any workspace a library allocates itself: none of it is counted by the allocator cap.
``MemoryBudget.context_bytes`` / ``cap_device_memory``'s ``context_reserve`` change it."""


@dataclass(frozen=True, slots=True)
class MemoryBudget:
    total_bytes: int
    """The device's memory."""
    fraction: float
    """Share of it this process may allocate."""
    weights_bytes: int
    """The model's weights as loaded."""
    bytes_per_slot: int
    """What one KV slot costs on the device: keys, values, its stream's hidden-state row and its row of
    the step graphs' pool (``engine.slot_memory``)."""
    context_bytes: int = CUDA_CONTEXT_RESERVE
    """Held outside torch's allocator (CUDA context, workspaces): taken off the allocator's cap."""

    def __post_init__(self) -> None:
        if not 0 < self.fraction <= 1:
            raise ValueError(f"max_memory_fraction must be in (0, 1], got {self.fraction!r}")
        if self.context_bytes < 0:
            raise ValueError(f"the CUDA context reserve must be >= 0 bytes, got {self.context_bytes!r}")

    @property
    def cap_bytes(self) -> int:
        """This process's share of the device, context included."""
        return int(self.total_bytes * self.fraction)

    @property
    def allocator_bytes(self) -> int:
        """What torch's allocator may take: the share less the context reserve."""
        return max(0, self.cap_bytes - self.context_bytes)

    @property
    def allocator_fraction(self) -> float:
        """``allocator_bytes`` as the fraction ``set_per_process_memory_fraction`` takes."""
        return self.allocator_bytes / self.total_bytes

    def num_slots(self, max_slots: int, reserve: float = ACTIVATION_RESERVE) -> int:
        """KV slots that fit in the allocator's cap once the weights and the reserve are set aside, at
        most ``max_slots``. Raises ValueError when not even one fits (the replica could not serve)."""
        free = self.allocator_bytes * (1 - reserve) - self.weights_bytes
        fit = int(free // self.bytes_per_slot) if free > 0 else 0
        if fit < 1:
            raise ValueError(
                f"max_memory_fraction {self.fraction:g} of {self.total_bytes / 2**30:.1f} GiB leaves no room for "
                f"one slot ({self.bytes_per_slot / 2**20:.0f} MiB) after "
                f"{self.weights_bytes / 2**20:.0f} MiB of weights and {self.context_bytes / 2**20:.0f} MiB for the "
                "CUDA context"
            )
        return min(max_slots, fit)


def weights_bytes(root: Path, precision: str) -> int:
    """The weights' size as loaded: the checkpoint's fp32 files, the GPT trunk at the precision's width."""
    import torch

    from ..kernels.quant import parse_precision
    from ..models.chattts.checkpoint import DECODER, DVAE_FILE, EMBED, GPT_WEIGHTS, VOCOS

    total = sum((root / rel).stat().st_size for rel in (GPT_WEIGHTS, EMBED, DECODER, DVAE_FILE, VOCOS))
    gpt = (root / GPT_WEIGHTS).stat().st_size
    width = torch.empty(0, dtype=parse_precision(precision).trunk_dtype).element_size()
    return total - gpt + gpt * width // 4


def budget_for(
    model: str, config: EngineConfig, device, fraction: float, context_reserve: int = CUDA_CONTEXT_RESERVE
) -> MemoryBudget:
    """The budget of ``fraction`` of ``device`` for the checkpoint at ``model``, read without loading it."""
    import torch

    from ..engine.plan import resolve_plan
    from ..engine.runner import slot_bytes
    from ..models.chattts import checkpoint

    root = checkpoint.resolve(model)
    dims = checkpoint.read_config(root)
    # The runner's own rule: the cache holds kv_cache_dtype (bf16 halves it; int8 with its scales, CPU only, is
    # refused here), not always the trunk's.
    plan = resolve_plan(config, "cuda")
    per_slot = slot_bytes(dims.gpt, config.scheduler.max_model_len, plan.kv_cache_dtype, graphs=plan.cuda_graphs)
    total = torch.cuda.get_device_properties(device).total_memory
    return MemoryBudget(total, fraction, weights_bytes(root, config.precision), per_slot, context_reserve)


def cap_device_memory(
    model: str,
    config: EngineConfig,
    device: str,
    fraction: float | None,
    context_reserve: int = CUDA_CONTEXT_RESERVE,
) -> EngineConfig:
    """On CUDA with a fraction: cap this process's allocator at the share less ``context_reserve`` and
    return ``config`` with the KV slots that fit (at most its own ``max_num_seqs``). Elsewhere
    ``config`` unchanged (a CPU has no such cap)."""
    import torch

    if fraction is None or not device.startswith("cuda") or not torch.cuda.is_available():
        if fraction is not None:
            logger.info("max_memory_fraction applies to CUDA devices only; ignored on %s", device)
        return config
    dev = torch.device(device)
    budget = budget_for(model, config, dev, fraction, context_reserve)
    slots = budget.num_slots(config.scheduler.max_num_seqs)  # refuses before capping anything
    torch.cuda.set_per_process_memory_fraction(budget.allocator_fraction, dev)
    logger.info(
        "memory cap %.0f MiB for torch + %.0f MiB for the CUDA context (%g of %s): %d KV slots",
        budget.allocator_bytes / 2**20,
        budget.context_bytes / 2**20,
        fraction,
        device,
        slots,
    )
    return replace(config, scheduler=replace(config.scheduler, max_num_seqs=slots), auto_slots=False)
