"""The "rows" decode path (the CPU default): ``GPT.decode``, every row attending over exactly its own keys
with the call a batch-1 decode makes, so a row's result never depends on the others (batch invariance; with
one slot in fp32, bit-exact with the reference). Slots and positions go in as host ints: on a CPU there is
no device to wait for.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..kernels import decode_attention
from .decode_path import DecodeStep, RunnerParts, TrunkDecode


class RowsDecode(TrunkDecode):
    name = "rows"

    def __init__(self, parts: RunnerParts) -> None:
        super().__init__(parts)
        self.gpt = parts.model.gpt
        self.dtype = self.gpt.norm.weight.dtype
        decode_attention.prepare(parts.cache.k)  # build the bf16/int8 cache's attention kernel now, not mid-request
        fused = self.gpt.fused_decode
        if fused is not None and parts.plan.audio_overlap and parts.plan.device == "cpu":
            # The audio worker has the other core: narrow int4 steps keep to this one (kernels.int4_decode).
            self.gpt.fused_decode = replace(fused, narrow_threads=1)

    def audio_beside(self, rows: int) -> bool:
        fused = self.gpt.fused_decode
        return fused is None or fused.shares_cores(rows)

    def trunk(self, emb: torch.Tensor, step: DecodeStep) -> torch.Tensor:
        slots = [s.slot for s in step.seqs]
        lengths = [s.cache_len for s in step.seqs]
        cache, pad = self.parts.cache, self.parts.layout.pad_rows_to
        return self.gpt.decode(emb.to(self.dtype), cache, slots, lengths, pad).float()
