"""Vocos vocoder: log-mel [B, 100, F] -> 24 kHz waveform [B, 256 * (F - 1)].

Names follow ``asset/Vocos.safetensors`` (``backbone.*``, ``head.*``). ConvNeXt backbone, then an
ISTFT head (513 log-magnitudes + 513 phases per frame) through ``torch.istft`` with centred frames.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import HOP_LENGTH, N_FFT, NUM_MELS, VocosConfig
from .dvae import ConvNeXtBlock
from .mel import MelBuffers, hann_window


class Backbone(nn.Module):
    def __init__(self, cfg: VocosConfig) -> None:
        super().__init__()
        self.embed = nn.Conv1d(NUM_MELS, cfg.dim, 7, padding=3)
        self.norm = nn.LayerNorm(cfg.dim, eps=1e-6)
        self.convnext = nn.ModuleList(
            ConvNeXtBlock(cfg.dim, cfg.intermediate_dim, 7, 1, scale_name="gamma") for _ in range(cfg.num_layers)
        )
        self.final_layer_norm = nn.LayerNorm(cfg.dim, eps=1e-6)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:  # [B, 100, F] -> [B, F, dim]
        x = self.norm(self.embed(mel).transpose(1, 2)).transpose(1, 2)
        for block in self.convnext:
            x = block(x)
        return self.final_layer_norm(x.transpose(1, 2))


class ISTFTHead(nn.Module):
    def __init__(self, cfg: VocosConfig) -> None:
        super().__init__()
        self.out = nn.Linear(cfg.dim, N_FFT + 2)
        self.istft = nn.Module()
        self.istft.register_buffer("window", hann_window(N_FFT))

    def spectrum(self, x: torch.Tensor) -> torch.Tensor:
        """[B, F, dim] -> complex STFT [B, 513, F]."""
        x = self.out(x).transpose(1, 2)
        log_mag, phase = x.chunk(2, dim=1)
        mag = torch.clip(torch.exp(log_mag), max=1e2)
        return mag * (torch.cos(phase) + 1j * torch.sin(phase))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spec = self.spectrum(x)
        return torch.istft(spec, N_FFT, HOP_LENGTH, N_FFT, self.istft.window, center=True)


class Vocos(nn.Module):
    def __init__(self, cfg: VocosConfig) -> None:
        super().__init__()
        self.feature_extractor = MelBuffers()
        self.backbone = Backbone(cfg)
        self.head = ISTFTHead(cfg)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(mel))
