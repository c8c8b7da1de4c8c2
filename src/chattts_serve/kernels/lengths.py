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


def masked_bilstm(lstm: torch.nn.LSTM, x: torch.Tensor, lengths: DeviceLengths) -> torch.Tensor:
    """A one-layer bidirectional ``lstm`` over [B, T, C] (batch first) that stops at each row's end, with the
    lengths on the device: what ``pack_padded_sequence`` does (whose lengths must be on the host). The forward
    direction runs over the padded batch (padding comes after a row's steps, so they never see it); the backward
    one over each row reversed within its length (a gather), then turned back. Padding comes back as zeros."""
    if lstm.num_layers != 1 or not lstm.bidirectional or not lstm.batch_first:
        raise ValueError("masked_bilstm takes a one-layer bidirectional batch-first LSTM")
    b, t, c = x.shape
    mask = lengths.mask(x.device, x.dtype).transpose(1, 2)  # [B, T, 1]
    x = x * mask
    steps = torch.arange(t, device=x.device)[None, :]
    n = lengths.lengths[:, None]
    flip = torch.where(steps < n, n - 1 - steps, steps)  # row b's step i <-> step n_b - 1 - i (an involution)
    h0 = x.new_zeros(1, b, lstm.hidden_size)
    names = ("weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0")
    forward = torch.lstm(x, (h0, h0), [getattr(lstm, k) for k in names], True, 1, 0.0, False, False, True)[0]
    reverse = [getattr(lstm, k + "_reverse") for k in names]
    rx = torch.gather(x, 1, flip[:, :, None].expand(-1, -1, c))
    backward = torch.lstm(rx, (h0, h0), reverse, True, 1, 0.0, False, False, True)[0]
    backward = torch.gather(backward, 1, flip[:, :, None].expand(-1, -1, backward.shape[2]))
    return torch.cat([forward, backward], dim=-1) * mask
