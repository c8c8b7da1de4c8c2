"""Text side: the acoustic text encoder, and the prosody predictor (durations, then F0 and energy).

All of it runs on padded batches: token-rate tensors at the token lengths, frame-rate tensors at the
frame lengths (a row's frames are the sum of its durations). Names follow the official state dict.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .blocks import AdainResBlk1d
from .layers import ChannelLayerNorm, Lengths, WNConv1d, masked, run_lstm


class TextEncoder(nn.Module):
    """Embedding -> ``depth`` x (conv, channel layer norm, LeakyReLU(0.2)) -> BiLSTM: [B, C, T]."""

    def __init__(self, channels: int, kernel_size: int, depth: int, n_symbols: int):
        super().__init__()
        self.embedding = nn.Embedding(n_symbols, channels)
        self.cnn = nn.ModuleList([
            nn.Sequential(WNConv1d(channels, channels, kernel_size, padding=(kernel_size - 1) // 2),
                          ChannelLayerNorm(channels))
            for _ in range(depth)
        ])
        self.lstm = nn.LSTM(channels, channels // 2, 1, batch_first=True, bidirectional=True)

    def forward(self, input_ids: torch.Tensor, lengths: Lengths) -> torch.Tensor:
        x = masked(self.embedding(input_ids).transpose(1, 2), lengths)
        for block in self.cnn:
            x = masked(F.leaky_relu(block(x), 0.2), lengths)
        x = run_lstm(self.lstm, x.transpose(1, 2), lengths)
        return x.transpose(1, 2)


class AdaLayerNorm(nn.Module):
    """Layer norm over channels with a style-computed scale and shift; [B, T, C] in and out."""

    def __init__(self, style_dim: int, channels: int, eps: float = 1e-5):
        super().__init__()
        self.channels = channels
        self.eps = eps
        self.fc = nn.Linear(style_dim, channels * 2)

    def forward(self, x: torch.Tensor, style: torch.Tensor) -> torch.Tensor:
        gamma, beta = torch.chunk(self.fc(style)[:, None, :], chunks=2, dim=-1)
        return (1 + gamma) * F.layer_norm(x, (self.channels,), eps=self.eps) + beta


class DurationEncoder(nn.Module):
    """``nlayers`` x (BiLSTM, AdaLayerNorm), the style concatenated to every frame before each LSTM.

    The official list interleaves the two kinds (``lstms.0`` an LSTM, ``lstms.1`` its norm, ...).
    """

    def __init__(self, style_dim: int, d_model: int, nlayers: int):
        super().__init__()
        self.lstms = nn.ModuleList()
        for _ in range(nlayers):
            self.lstms.append(nn.LSTM(d_model + style_dim, d_model // 2, 1, batch_first=True, bidirectional=True))
            self.lstms.append(AdaLayerNorm(style_dim, d_model))

    def forward(self, x: torch.Tensor, style: torch.Tensor, lengths: Lengths) -> torch.Tensor:
        """``x`` [B, C, T] -> [B, T, C + style_dim] (the style rides along on every token)."""
        styles = style[:, None, :].expand(-1, x.shape[2], -1)
        mask = lengths.mask(x.device, x.dtype).transpose(1, 2)  # [B, T, 1]
        h = torch.cat([x.transpose(1, 2), styles], dim=-1) * mask
        for lstm, norm in zip(self.lstms[0::2], self.lstms[1::2], strict=True):
            h = run_lstm(lstm, h, lengths)
            h = torch.cat([norm(h, style), styles], dim=-1) * mask
        return h


class ProsodyPredictor(nn.Module):
    def __init__(self, style_dim: int, d_hid: int, nlayers: int, max_dur: int):
        super().__init__()
        self.text_encoder = DurationEncoder(style_dim, d_hid, nlayers)
        self.lstm = nn.LSTM(d_hid + style_dim, d_hid // 2, 1, batch_first=True, bidirectional=True)
        self.duration_proj = _LinearNorm(d_hid, max_dur)
        self.shared = nn.LSTM(d_hid + style_dim, d_hid // 2, 1, batch_first=True, bidirectional=True)
        self.F0 = _curve_blocks(d_hid, style_dim)
        self.N = _curve_blocks(d_hid, style_dim)
        self.F0_proj = nn.Conv1d(d_hid // 2, 1, 1, 1, 0)
        self.N_proj = nn.Conv1d(d_hid // 2, 1, 1, 1, 0)

    def durations(self, d: torch.Tensor, lengths: Lengths, speeds: list[float]) -> torch.Tensor:
        """Frames per token [B, T] (int64, at least 1; 0 on padding): round(sum of max_dur sigmoids / speed).

        The package runs this LSTM unpacked; so do we when no row is padded. Each row divides by its own
        speed as a Python float, as the package does (a tensor divisor takes another kernel).
        """
        x = run_lstm(self.lstm, d, lengths, pack=False)
        total = torch.sigmoid(self.duration_proj.linear_layer(x)).sum(dim=-1)
        duration = torch.stack([total[row] / speed for row, speed in enumerate(speeds)])
        frames = torch.round(duration).clamp(min=1).long()
        return frames * lengths.mask(frames.device, frames.dtype)[:, 0, :]

    def curves(self, en: torch.Tensor, style: torch.Tensor, frames: Lengths) -> tuple[torch.Tensor, torch.Tensor]:
        """F0 and energy [B, 2F] from the frame-aligned encoding ``en`` [B, C, F] (zero past each row's end)."""
        x = run_lstm(self.shared, en.transpose(1, 2), frames, pack=False).transpose(1, 2)
        curves = []
        for blocks, proj in ((self.F0, self.F0_proj), (self.N, self.N_proj)):
            h, at = x, frames
            for block in blocks:
                h = block(h, style, at)
                at = at.scaled(2) if block.upsample else at
            curves.append(masked(proj(h), at)[:, 0, :])
        return curves[0], curves[1]


class _LinearNorm(nn.Module):
    """The official file nests the duration head one level down (``duration_proj.linear_layer``)."""

    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.linear_layer = nn.Linear(in_dim, out_dim)


def _curve_blocks(d_hid: int, style_dim: int) -> nn.ModuleList:
    return nn.ModuleList([
        AdainResBlk1d(d_hid, d_hid, style_dim),
        AdainResBlk1d(d_hid, d_hid // 2, style_dim, upsample=True),
        AdainResBlk1d(d_hid // 2, d_hid // 2, style_dim),
    ])
