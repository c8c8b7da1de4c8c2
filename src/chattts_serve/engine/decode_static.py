"""The "static" decode path (the CUDA default without step graphs): ``GPT.decode_static`` with row b = KV
slot b and fixed shapes, replayed from one CUDA graph per (batch, context) bucket where graphs are captured
(``engine.cuda_graph.StaticDecoder``). Slots and positions come from the device (the step plan and the slot
state): nothing is read back.
"""

from __future__ import annotations

import torch

from .cuda_graph import StaticDecoder
from .decode_path import DecodeStep, RunnerParts, TrunkDecode


def static_decoder(parts: RunnerParts, graphs: bool) -> StaticDecoder:
    """The static step over the runner's cache (its rows read finite values: zeroed), capturing its own
    graphs if ``graphs``."""
    p = parts.plan
    parts.cache.zero_()  # rows that decode nothing read finite values
    return StaticDecoder(
        parts.model.gpt, parts.cache, graphs, p.compile, p.strict_cuda_graphs, parts.graph_store, p.attention
    )


class StaticDecode(TrunkDecode):
    name = "static"

    def __init__(self, parts: RunnerParts) -> None:
        super().__init__(parts)
        self.static = static_decoder(parts, parts.plan.trunk_graphs)

    def trunk(self, emb: torch.Tensor, step: DecodeStep) -> torch.Tensor:
        plan = step.plan
        max_len = max(s.cache_len for s in step.seqs)
        positions = self.parts.slot_state.positions(plan.dec_slots)
        return self.static.run(emb, plan.dec_slots, positions, plan.max_slot, max_len).float()

    def counters(self) -> dict[str, int]:
        s = self.static
        return {"graph_replays": s.graph_replays, "eager_steps": s.eager_steps, "graphs_refused": s.graphs_refused}
