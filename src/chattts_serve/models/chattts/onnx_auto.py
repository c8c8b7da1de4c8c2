"""``ort-auto``: the 4-bit trunk while few rows go through a step, the int8 trunk from a crossover on.

ORT's 4-bit ``MatMulNBits`` weights are fewer bytes than int8's (114 vs 183 MB with their scales at full
size), which wins while a step is bound by reading them (one stream: 1.34 s vs 1.78 s on a 2-core Zen 4); its
kernel computes slower per row, so at 32 rows the int8 ``DynamicQuantizeMatMul`` wins by far (16.9 s vs 26.2 s
for 32 texts; issue 24). ``AutoTrunk`` holds both sessions (the int4 and int8 exports of the same trunk, each
cached by ``onnx_cache``) over ONE KV cache: both graphs are ``onnx_graph``'s with only their MatMul weights
quantised, so their caches have the same fp32 layout and either session continues what the other cached. Each
call goes to one session by its width.

The width is the number of rows the call's matmuls compute: rows x positions of the call's input
(``embeds``), idle rows and right padding included, because the kernels compute them too. A decode step
over a block of B slots is B; a prefill is its rows x the longest prompt, which is above any useful
crossover, so prompts go to int8 in practice.

The crossover comes from a table keyed by the CPU's int8 units (``CROSSOVER_TABLE``) unless the config
sets one (``RunnerConfig.ort_auto_crossover``, ``--ort-auto-crossover``). Not measured at start-up: a
timing on a shared box moves from one start to the next, and the crossover decides which kernel
computes a request's codes, so a measured one would make seeded output change between restarts.

What ``ort-auto`` does not keep: batch invariance. A request's codes depend on which session ran each
of its steps, that is on how many rows decoded with it (README, "Determinism").
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from ...cpu import CpuInfo, probe
from .gpt import KVCache
from .onnx_trunk import OnnxTrunk, OpProfile

logger = logging.getLogger(__name__)

CROSSOVER_TABLE: dict[str, int] = {
    # Measured (2-core AMD EPYC Zen 4, full-size checkpoint, one decode step, int4 and int8 calls
    # alternating, shared machine): int4 1.3-1.6x faster at 1 row, 1.1-1.3x at 2, even at 3, int8
    # ahead from 4 (1.0-1.4x) and 1.6-2.8x at 6-32 rows.
    "avx512_vnni": 4,
    # Not measured: the AVX-512 figure until someone runs the crossover on such a CPU (then amend).
    "amx": 4,  # AMX's int8 tiles may favour int8 from fewer rows
    "avx2": 4,  # without VNNI the int8 kernel is slower (and 7-bit): perhaps a higher crossover
    "other": 4,
}
"""Rows from which a call runs the int8 trunk, by ``CpuInfo.kind``; below it, the 4-bit trunk."""


def resolve_crossover(configured: int = 0, cpu: CpuInfo | None = None) -> tuple[int, str]:
    """The crossover to run with and where it came from: ``configured`` when > 0, else the table's
    entry for ``cpu`` (default: this machine's, ``cpu.probe()``)."""
    if configured < 0:
        raise ValueError(f"ort_auto_crossover must be >= 0 (0: from the CPU table), got {configured}")
    if configured:
        return configured, "configured"
    kind = (cpu or probe()).kind
    return CROSSOVER_TABLE[kind], f"table ({kind})"


class AutoTrunk:
    """Two ``OnnxTrunk`` sessions of the same trunk over one cache: calls narrower than ``crossover``
    rows run ``small`` (4-bit weights), the others ``large`` (int8). The runner sees one trunk."""

    def __init__(self, small: OnnxTrunk, large: OnnxTrunk, crossover: int) -> None:
        if crossover < 1:
            raise ValueError(f"crossover must be >= 1 row, got {crossover}")
        if small.cfg != large.cfg or small.device != large.device:
            raise ValueError("the two trunks of ort-auto must be exports of the same model on the same device")
        self.small, self.large = small, large
        self.crossover = crossover
        self.cfg = small.cfg
        self.device = small.device
        self.calls = {"small": 0, "large": 0}
        """Calls each session ran: which kernel the traffic got (``eval``, tests)."""
        self.rows = {"small": 0, "large": 0}
        """Matmul rows (the calls' widths) each session computed."""

    @property
    def max_positions(self) -> int:
        return min(self.small.max_positions, self.large.max_positions)

    @property
    def weight_bytes(self) -> int:
        """Both exports' bytes: what the process holds (a step reads one of them: ``for_rows``)."""
        return self.small.weight_bytes + self.large.weight_bytes

    def for_rows(self, rows: int) -> OnnxTrunk:
        """The session a call computing ``rows`` matmul rows runs in."""
        return self.small if rows < self.crossover else self.large

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        # The same fp32 [layers, slots, kv_heads, positions, head_dim] layout for both (same graph).
        if max_len > self.max_positions:
            raise ValueError(f"cache of {max_len} positions exceeds the export's rotary table ({self.max_positions})")
        return self.small.new_cache(num_slots, max_len)

    def run(
        self,
        embeds: torch.Tensor,
        cache: KVCache,
        lo: int,
        seqlens_k: np.ndarray,
        query_seqlens: np.ndarray,
    ) -> torch.Tensor:
        """``OnnxTrunk.run`` in the session for this call's width (rows x positions of ``embeds``)."""
        rows = embeds.shape[0] * embeds.shape[1]
        trunk = self.for_rows(rows)
        which = "small" if trunk is self.small else "large"
        self.calls[which] += 1
        self.rows[which] += rows
        return trunk.run(embeds, cache, lo, seqlens_k, query_seqlens)

    def start_op_profile(self, directory: str | Path) -> None:
        """Both sessions' profilers on (``OnnxTrunk.start_op_profile``), each writing in its own folder."""
        for name, trunk in (("small", self.small), ("large", self.large)):
            sub = Path(directory) / name
            sub.mkdir(parents=True, exist_ok=True)
            trunk.start_op_profile(sub)

    def end_op_profile(self) -> OpProfile:
        """Both sessions' profiles as one: the large session's events shifted past the small one's, and
        the run kinds in that order (``bench.ort_ops.op_seconds`` pairs runs with kinds by time)."""
        first, second = self.small.end_op_profile(), self.large.end_op_profile()
        end = max((e.get("ts", 0) + e.get("dur", 0) for e in first.events), default=0)
        shifted = [{**e, "ts": e["ts"] + end + 1} if "ts" in e else e for e in second.events]
        return OpProfile(first.events + shifted, first.kinds + second.kinds)
