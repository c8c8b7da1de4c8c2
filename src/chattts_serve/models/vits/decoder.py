"""The HiFi-GAN decoder (latent frames -> waveform), batched over padded rows and streamable in chunks.

transformers runs its decoder on a padded batch without masks, so a short row's last samples see its
neighbours' padding (a bias-filled, non-zero tail): a padded row's audio changes with its batch. Here every
convolution's input is masked at its own rate (``masks.masked``), so a row sees zeros past its end exactly as
it does alone.

Streaming: the decoder is a stack of convolutions with a finite receptive field (``receptive_field``, in latent
frames), so the audio of frames [start, end) needs only the latent frames within that many frames of them.
``decode_range`` decodes such a window and keeps the middle; the pieces of ``decode_chunks`` joined equal the
one-shot waveform up to float rounding (different shapes pick different kernel blockings; measured < 1e-6 on
random weights, see tests/models/vits/test_stream.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch import nn
from torch.nn import functional as F

from .config import VitsConfig
from .masks import Lengths, masked


class ResidualBlock(nn.Module):
    def __init__(self, channels: int, kernel_size: int, dilation: tuple[int, ...], slope: float):
        super().__init__()
        self.slope = slope
        self.convs1 = nn.ModuleList(nn.Conv1d(channels, channels, kernel_size, dilation=d,
                                              padding=(kernel_size * d - d) // 2) for d in dilation)
        self.convs2 = nn.ModuleList(nn.Conv1d(channels, channels, kernel_size, padding=(kernel_size - 1) // 2)
                                    for _ in dilation)

    def forward(self, x: torch.Tensor, lengths: Lengths) -> torch.Tensor:
        for conv1, conv2 in zip(self.convs1, self.convs2, strict=True):
            residual = x
            x = masked(conv1(F.leaky_relu(x, self.slope)), lengths)
            x = masked(conv2(F.leaky_relu(x, self.slope)), lengths)
            x = x + residual
        return x


class HifiGan(nn.Module):
    def __init__(self, config: VitsConfig):
        super().__init__()
        self.slope = config.leaky_relu_slope
        self.rates = config.upsample_rates
        self.num_kernels = len(config.resblock_kernel_sizes)
        channels = config.upsample_initial_channel
        self.conv_pre = nn.Conv1d(config.flow_size, channels, kernel_size=7, stride=1, padding=3)
        self.upsampler = nn.ModuleList()
        self.resblocks = nn.ModuleList()
        for i, (rate, kernel) in enumerate(zip(config.upsample_rates, config.upsample_kernel_sizes, strict=True)):
            self.upsampler.append(nn.ConvTranspose1d(channels // 2**i, channels // 2 ** (i + 1), kernel_size=kernel,
                                                     stride=rate, padding=(kernel - rate) // 2))
            for k, d in zip(config.resblock_kernel_sizes, config.resblock_dilation_sizes, strict=True):
                self.resblocks.append(ResidualBlock(channels // 2 ** (i + 1), k, d, config.leaky_relu_slope))
        self.conv_post = nn.Conv1d(channels // 2 ** len(self.rates), 1, kernel_size=7, stride=1, padding=3,
                                   bias=False)
        if config.speaker_embedding_size:
            self.cond = nn.Conv1d(config.speaker_embedding_size, channels, 1)
        self.receptive_field = receptive_field(config)

    def forward(self, latent: torch.Tensor, lengths: Lengths, speaker: torch.Tensor | None = None) -> torch.Tensor:
        """``latent`` [B, flow_size, T] (zero past each row's length) -> waveform [B, T * samples_per_frame]."""
        x = masked(self.conv_pre(latent), lengths)
        if speaker is not None:
            x = masked(x + self.cond(speaker), lengths)
        for i, rate in enumerate(self.rates):
            lengths = lengths.scaled(rate)
            x = masked(self.upsampler[i](F.leaky_relu(x, self.slope)), lengths)
            res = self.resblocks[i * self.num_kernels](x, lengths)
            for j in range(1, self.num_kernels):
                res += self.resblocks[i * self.num_kernels + j](x, lengths)
            x = res / self.num_kernels
        x = self.conv_post(F.leaky_relu(x))  # torch's default slope (0.01) here, as VITS
        return torch.tanh(x).squeeze(1)

    def decode_range(self, latent: torch.Tensor, start: int, end: int, speaker: torch.Tensor | None = None
                     ) -> torch.Tensor:
        """The audio of latent frames [start, end) of one row (``latent`` [1, C, T]), computed from a window
        that reaches ``receptive_field`` frames past each side: [(end - start) * samples_per_frame]."""
        total = latent.shape[-1]
        if not 0 <= start < end <= total:
            raise ValueError(f"frame range [{start}, {end}) is not inside [0, {total})")
        lo, hi = max(0, start - self.receptive_field), min(total, end + self.receptive_field)
        audio = self.forward(latent[..., lo:hi], Lengths([hi - lo]), speaker)[0]
        hop = math.prod(self.rates)
        return audio[(start - lo) * hop : (end - lo) * hop]

    def decode_chunks(self, latent: torch.Tensor, chunk_frames: int, speaker: torch.Tensor | None = None
                      ) -> Iterator[torch.Tensor]:
        """One row's audio in pieces of ``chunk_frames`` latent frames (the last may be shorter)."""
        if chunk_frames < 1:
            raise ValueError(f"chunk_frames must be positive, got {chunk_frames}")
        total = latent.shape[-1]
        for start in range(0, total, chunk_frames):
            yield self.decode_range(latent, start, min(total, start + chunk_frames), speaker)


def receptive_field(config: VitsConfig) -> int:
    """How many latent frames on each side of a frame can change its audio (rounded up).

    Walks the stack: conv_pre (3 frames); per stage, a transposed convolution reaches ceil(kernel / rate) input
    frames, and the widest residual block sum((k - 1) / 2 * (d + 1)) samples at that stage's rate; conv_post
    3 samples at the output rate. Summed as frames of the latent, it is an upper bound.
    """
    frames = 3.0
    rate = 1
    for r, k in zip(config.upsample_rates, config.upsample_kernel_sizes, strict=True):
        frames += math.ceil(k / r) / rate
        rate *= r
        widest = max(sum((ks - 1) // 2 * (d + 1) for d in dil)
                     for ks, dil in zip(config.resblock_kernel_sizes, config.resblock_dilation_sizes, strict=True))
        frames += widest / rate
    frames += 3 / rate
    return math.ceil(frames)
