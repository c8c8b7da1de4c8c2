"""Per-row lengths held on the device: the masks of a bucket-padded forward that a CUDA graph can capture.

The batch families (Kokoro, VITS) mask a padded batch with host lengths (their ``Lengths``: a Python list or a
CPU tensor, a ``ragged`` flag, per-row slices where a statistic needs them). A CUDA graph takes no host value,
so its forward gets :class:`DeviceLengths` instead: the same interface (``total``, ``ragged``, ``mask``,
``scaled``), the lengths a device tensor, every row treated as padded, and :func:`masked_instance_norm` where
the host code normalises row by row. Each row still computes what it computes alone (zeros past its end), up
to the rounding of the masked statistics.
"""

from __future__ import annotations

import torch


class DeviceLengths:
    """Valid lengths ``[B]`` (int64, on the device) of a batch padded to ``total`` steps at one rate."""

    ragged = True
    """Always masked: whether any row is padded is a device value, and the graph's kernels must not depend on it."""

    def __init__(self, lengths: torch.Tensor, total: int):
        self.lengths = lengths
        self.total = total
        self._masks: dict[torch.dtype, torch.Tensor] = {}

    def mask(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """[B, 1, T] of 1 on a row's steps, 0 on its padding (built on the lengths' device, once per dtype)."""
        if dtype not in self._masks:
            steps = torch.arange(self.total, device=self.lengths.device)
            self._masks[dtype] = (steps[None, :] < self.lengths[:, None]).to(dtype)[:, None, :]
        return self._masks[dtype]

    def scaled(self, factor: int, extra: int = 0) -> DeviceLengths:
        """The same rows at a rate ``factor`` times faster (plus ``extra`` steps, e.g. a centred STFT)."""
        return DeviceLengths(self.lengths * factor + extra, self.total * factor + extra)

    def __len__(self) -> int:
        return int(self.lengths.shape[0])


def masked_instance_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, lengths: DeviceLengths,
                         eps: float = 1e-5) -> torch.Tensor:
    """Instance norm of [B, C, T] whose statistics cover each row's own steps (biased variance, as
    ``F.instance_norm``); padding comes back as zero. Two passes (mean, then the centred squares), as the
    kernel does, so a row's result differs from its unpadded one by rounding only."""
    mask = lengths.mask(x.device, x.dtype)
    count = lengths.lengths.to(x.dtype).clamp(min=1)[:, None, None]
    mean = (x * mask).sum(dim=2, keepdim=True) / count
    centred = (x - mean) * mask
    var = (centred * centred).sum(dim=2, keepdim=True) / count
    return centred * torch.rsqrt(var + eps) * weight[None, :, None] + bias[None, :, None] * mask
