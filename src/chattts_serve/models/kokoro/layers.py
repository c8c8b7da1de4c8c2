"""The small pieces every Kokoro block is built from, written for padded batches.

A batch holds utterances of different lengths, right-padded. Three rules make every row compute what it
would compute alone:

- a convolution sees zeros past a row's end, as it would see its own zero padding alone: every
  convolution's input goes through :func:`masked` first;
- a statistic over time (instance norm) is taken over the row's own frames only: :func:`instance_norm`
  normalises each row on its own slice when the rows differ in length;
- a recurrence over time (LSTM) stops at the row's end, so the backward direction starts there:
  :func:`run_lstm` packs the batch when it is padded.

Module attribute names follow the official state dict (``weight``/``bias`` of the convolutions, with the
weight-norm pairs folded at load), which is why some read oddly (``gamma``/``beta``, ``norm.weight``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ...kernels.lengths import DeviceLengths, masked_bilstm, masked_instance_norm


class Lengths:
    """Per-row valid lengths of a padded batch at one time rate, with the mask built once."""

    def __init__(self, lengths: torch.Tensor, total: int):
        self.lengths = lengths  # int64 [B], on the CPU (pack_padded_sequence wants it there)
        self.total = total
        self.ragged = bool((lengths != total).any())
        self._mask: torch.Tensor | None = None

    def mask(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """[B, 1, T] of 1 on valid frames, 0 on padding."""
        if self._mask is None or self._mask.device != device or self._mask.dtype != dtype:
            steps = torch.arange(self.total)
            self._mask = (steps[None, :] < self.lengths[:, None]).to(device=device, dtype=dtype)[:, None, :]
        return self._mask

    def scaled(self, factor: int, extra: int = 0) -> Lengths:
        """The same rows at a rate ``factor`` times faster (plus ``extra`` samples, e.g. a centred STFT)."""
        return Lengths(self.lengths * factor + extra, self.total * factor + extra)

    def __len__(self) -> int:
        return int(self.lengths.shape[0])


def masked(x: torch.Tensor, lengths: Lengths) -> torch.Tensor:
    """``x`` [B, C, T] with the padding zeroed; a no-op (no copy) when no row is padded."""
    if not lengths.ragged:
        return x
    return x * lengths.mask(x.device, x.dtype)


class StyledInstanceNorm(nn.Module):
    """AdaIN: instance norm over time, then a per-utterance scale and shift computed from the style.

    The package builds ``nn.InstanceNorm1d(affine=True)``; the official weights carry no affine
    parameters, so they stay at 1 and 0. We keep them (``norm.weight``/``norm.bias``) because the
    package passes them to the kernel, and the kernel rounds differently with an affine than without.
    """

    def __init__(self, style_dim: int, channels: int):
        super().__init__()
        self.norm = _AffineOnly(channels)
        self.fc = nn.Linear(style_dim, channels * 2)

    def forward(self, x: torch.Tensor, style: torch.Tensor, lengths: Lengths) -> torch.Tensor:
        h = self.fc(style)
        h = h.view(h.size(0), h.size(1), 1)
        gamma, beta = torch.chunk(h, chunks=2, dim=1)
        # In place on the norm's fresh output: the same products and sums as (1 + gamma) * norm + beta.
        return instance_norm(x, self.norm.weight, self.norm.bias, lengths).mul_(1 + gamma).add_(beta)


class _AffineOnly(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))


def instance_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, lengths: Lengths,
                  eps: float = 1e-5) -> torch.Tensor:
    """Instance norm whose statistics cover each row's own frames.

    Rows of one length go through one kernel call. Ragged rows are normalised one by one on their own
    slices, with the same kernel a lone utterance uses, so a row's result does not depend on its batch
    (norms are cheap next to the convolutions around them; the padding is left at zero). Lengths on the device
    (a CUDA graph's bucket-padded forward) take masked statistics instead: no host value.
    """
    if isinstance(lengths, DeviceLengths):
        return masked_instance_norm(x, weight, bias, lengths, eps)
    if not lengths.ragged:
        return F.instance_norm(x, weight=weight, bias=bias, use_input_stats=True, eps=eps)
    out = torch.zeros_like(x)
    for row, n in enumerate(lengths.lengths.tolist()):
        out[row : row + 1, :, :n] = F.instance_norm(x[row : row + 1, :, :n], weight=weight, bias=bias,
                                                    use_input_stats=True, eps=eps)
    return out


def run_lstm(lstm: nn.LSTM, x: torch.Tensor, lengths: Lengths, pack: bool = True) -> torch.Tensor:
    """A bidirectional LSTM over [B, T, C] that stops at each row's end; padding comes back as zeros.

    ``pack=False`` runs the plain (unpacked) recurrence when no row is padded, as the package does for
    its frame-level LSTMs: packing changes the kernel and so the last bits of the result.
    """
    if isinstance(lengths, DeviceLengths):  # a CUDA graph's padded forward: no host lengths to pack by
        return masked_bilstm(lstm, x, lengths)
    if not pack and not lengths.ragged:
        return lstm(x)[0]
    packed = nn.utils.rnn.pack_padded_sequence(x, lengths.lengths, batch_first=True, enforce_sorted=False)
    out, _ = lstm(packed)
    out, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=lengths.total)
    return out


class ChannelLayerNorm(nn.Module):
    """Layer norm over the channels of a [B, C, T] tensor (the names are the official ``gamma``/``beta``)."""

    def __init__(self, channels: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.gamma = nn.Parameter(torch.ones(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.layer_norm(x.transpose(1, -1), (x.shape[1],), self.gamma, self.beta, self.eps)
        return x.transpose(1, -1)


class WNConv1d(nn.Conv1d):
    """A convolution stored as a weight-norm pair (``weight_g``, ``weight_v``) in the official file.

    Only a marker: the loader folds the pair into ``weight`` once, so the forward is a plain conv.
    """


class WNConvTranspose1d(nn.ConvTranspose1d):
    """A transposed convolution stored as a weight-norm pair (see :class:`WNConv1d`)."""


def weight_normed(module: nn.Module) -> list[str]:
    """The state-dict prefixes (``decoder.encode.conv1``...) whose weights the official file stores as pairs."""
    return [name for name, m in module.named_modules() if isinstance(m, (WNConv1d, WNConvTranspose1d))]
