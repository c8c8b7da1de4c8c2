"""Padded batches at one time rate: per-row lengths and the [B, 1, T] mask, built once per rate.

Every convolution of the batched parts (the flow and the decoder) sees zeros past a row's end, as it would
see its own zero padding alone: the input of each convolution is multiplied by the mask. When no row is
padded the mask is skipped altogether (a multiply by ones is exact, but costs a pass over the tensor).
"""

from __future__ import annotations

import torch


class Lengths:
    def __init__(self, lengths: list[int], total: int | None = None):
        self.lengths = list(lengths)
        self.total = max(self.lengths) if total is None else total
        self.ragged = any(n != self.total for n in self.lengths)
        self._mask: torch.Tensor | None = None

    def mask(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """[B, 1, T]: 1 on a row's frames, 0 on its padding."""
        if self._mask is None or self._mask.device != device or self._mask.dtype != dtype:
            steps = torch.arange(self.total, device=device)
            lengths = torch.tensor(self.lengths, device=device)
            self._mask = (steps[None, :] < lengths[:, None]).to(dtype)[:, None, :]
        return self._mask

    def scaled(self, factor: int) -> Lengths:
        return Lengths([n * factor for n in self.lengths], self.total * factor)

    def __len__(self) -> int:
        return len(self.lengths)


def masked(x: torch.Tensor, lengths: Lengths) -> torch.Tensor:
    """``x`` [B, C, T] with each row's padding zeroed (no copy when nothing is padded)."""
    if not lengths.ragged:
        return x
    return x * lengths.mask(x.device, x.dtype)
