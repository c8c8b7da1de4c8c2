"""The "onnx" decode path (the ``ort-*`` precisions): one ONNX Runtime step over the slot block
``min(slots) .. max(slots)`` (one contiguous piece of each layer's cache, bound without a copy;
``models.chattts.onnx_trunk``). Slots in between that decode nothing this step (free, or prefilled this
step) are idle rows: zero input, and their cache is left as it is.
"""

from __future__ import annotations

import numpy as np
import torch

from .decode_path import DecodeStep, RunnerParts, TrunkDecode
from .outputs import PrefillChunk
from .prefill_runner import Pieces, Prefiller, onnx_prefill


class OnnxDecode(TrunkDecode):
    name = "onnx"

    def __init__(self, parts: RunnerParts) -> None:
        super().__init__(parts)
        assert parts.layout.trunk is not None, "the onnx path needs an ort-* layout"
        self.session = parts.layout.trunk

    def prefill(self, prefiller: Prefiller, chunks: list[PrefillChunk], last_only: bool = False) -> Pieces:
        return onnx_prefill(prefiller, chunks, last_only)

    def trunk(self, emb: torch.Tensor, step: DecodeStep) -> torch.Tensor:
        slots = [s.slot for s in step.seqs]
        lo = min(slots)
        rows = [s - lo for s in slots]
        block = max(slots) - lo + 1
        x = emb.new_zeros(block, 1, emb.shape[1])
        x[rows, 0] = emb
        seqlens_k = np.zeros(block, dtype=np.int32)
        seqlens_k[rows] = [s.cache_len for s in step.seqs]  # the new token goes to position cache_len
        active = np.zeros(block, dtype=np.int32)
        active[rows] = 1
        return self.session.run(x, self.parts.cache, lo, seqlens_k, active)[rows, 0]
