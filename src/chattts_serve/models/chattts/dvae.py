"""Decoder (GPT hidden states -> log-mel, the default path) and DVAE (codes <-> log-mel).

Names follow ``asset/Decoder.safetensors`` and ``asset/DVAE.safetensors``. Both decoders expand each
GPT step into two mel frames by splitting the channels in half (frame 2t = first half of step t,
frame 2t+1 = second half), run a ConvNeXt stack, an output conv, and scale by ``coef``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import NUM_MELS, ConvStackConfig, DecoderConfig, DVAEConfig
from .mel import MelBuffers, log_mel_spectrogram


class ConvNeXtBlock(nn.Module):
    """x + scale * pw2(gelu(pw1(LN(dwconv(x))))). The layer-scale parameter is called ``weight`` in
    the DVAE/Decoder checkpoints and ``gamma`` in Vocos; ``scale_name`` picks which."""

    def __init__(self, dim: int, intermediate: int, kernel: int, dilation: int, scale_name: str = "weight"):
        super().__init__()
        self.dwconv = nn.Conv1d(dim, dim, kernel, padding=dilation * (kernel // 2), dilation=dilation, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, intermediate)
        self.pwconv2 = nn.Linear(intermediate, dim)
        self.scale_name = scale_name
        self.register_parameter(scale_name, nn.Parameter(torch.ones(dim)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, T]
        y = self.dwconv(x).transpose(1, 2)
        y = self.pwconv2(F.gelu(self.pwconv1(self.norm(y))))
        y = y * getattr(self, self.scale_name)
        return x + y.transpose(1, 2)


class ConvStack(nn.Module):
    def __init__(self, cfg: ConvStackConfig) -> None:
        super().__init__()
        self.conv_in = nn.Sequential(
            nn.Conv1d(cfg.idim, cfg.bn_dim, 3, 1, 1),
            nn.GELU(),
            nn.Conv1d(cfg.bn_dim, cfg.hidden, 3, 1, 1),
        )
        self.decoder_block = nn.ModuleList(
            ConvNeXtBlock(cfg.hidden, cfg.hidden * 4, cfg.kernel, cfg.dilation) for _ in range(cfg.num_layers)
        )
        self.conv_out = nn.Conv1d(cfg.hidden, cfg.odim, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_in(x)
        for block in self.decoder_block:
            x = block(x)
        return self.conv_out(x)


def expand_frames(x: torch.Tensor) -> torch.Tensor:
    """[B, 2C, T] -> [B, C, 2T]: mel frame 2t takes channels [0, C) of step t, 2t+1 takes [C, 2C)."""
    b, c2, t = x.shape
    return x.view(b, 2, c2 // 2, t).permute(0, 2, 3, 1).flatten(2)


class Decoder(nn.Module):
    """GPT hidden states [B, hidden, T] -> log-mel [B, 100, 2T]."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.register_buffer("coef", torch.ones(1, NUM_MELS, 1))
        self.decoder = ConvStack(cfg.stack)
        self.out_conv = nn.Conv1d(cfg.stack.odim, NUM_MELS, 3, 1, 1, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.out_conv(self.decoder(expand_frames(hidden))) * self.coef


class GFSQ(nn.Module):
    """Grouped residual finite scalar quantizer (semantics of vector_quantize_pytorch <= 1.25).

    Code index i of a level-L^d codebook maps to the d-dim code ((i // L^k) % L - L//2) / (L//2);
    residual level r is scaled by (L-1)^-r. Index column order is g * R + r.
    """

    def __init__(self, cfg: DVAEConfig) -> None:
        super().__init__()
        self.groups, self.residuals = cfg.groups, cfg.residuals
        d = len(cfg.levels)
        group_dim = cfg.vq_dim // cfg.groups
        self.rvqs = nn.ModuleList(_ResidualFSQ(group_dim, d) for _ in range(cfg.groups))
        self.level_values = tuple(cfg.levels)
        self.init_buffers()

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """(Re)build the non-persistent buffers, e.g. after loading onto a meta-device module."""
        with torch.device(device or "cpu"):
            levels = torch.tensor(self.level_values, dtype=torch.int32)
            basis = torch.cumprod(torch.tensor([1, *self.level_values[:-1]]), 0, dtype=torch.int32)
            half = levels // 2
            all_idx = torch.arange(math.prod(self.level_values))
            codebook = ((all_idx[:, None] // basis) % levels - half) / half  # [num_codes, d]
            scales = torch.stack([(levels.float() - 1) ** -r for r in range(self.residuals)])  # [R, d]
        self.register_buffer("levels", levels, persistent=False)
        self.register_buffer("basis", basis, persistent=False)
        self.register_buffer("codebook", codebook.float(), persistent=False)
        self.register_buffer("scales", scales, persistent=False)

    def dequantize(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, G*R, T] -> features [B, vq_dim, T]."""
        b, _, t = codes.shape
        idx = codes.transpose(1, 2).reshape(b, t, self.groups, self.residuals).long()
        outs = []
        for g in range(self.groups):
            summed = (self.codebook[idx[:, :, g]] * self.scales[None, None]).sum(dim=2)  # [B, T, d]
            outs.append(self.rvqs[g].project_out(summed))
        return torch.cat(outs, dim=-1).transpose(1, 2)

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """features [B, vq_dim, T] -> codes [B, G*R, T] int32."""
        return self.quantize_with_margin(x)[0]

    def quantize_with_margin(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """features [B, vq_dim, T] -> (codes [B, G*R, T] int32, margin [B, G*R, T] float).

        ``margin`` is how far the value rounded to each code lies from the nearest rounding boundary
        (the smallest over the code's dimensions, in units of one level). A code whose margin is
        within float noise may round the other way on another CPU: tests that compare encoder codes
        across machines read it to tell a near-tie from a real difference."""
        x = x.transpose(1, 2)
        half_l = (self.levels - 1) * (1 + 1e-3) / 2
        half_width = self.levels // 2
        group_inds, group_margins = [], []
        for g, chunk in enumerate(x.chunk(self.groups, dim=-1)):
            residual = self.rvqs[g].project_in(chunk)
            inds, margins = [], []
            for r in range(self.residuals):
                scale = self.scales[r]
                value = torch.tanh(residual / scale) * half_l
                margins.append((value - value.floor() - 0.5).abs().amin(-1))
                code = torch.round(value) / half_width
                inds.append(((code * half_width + half_width) * self.basis).sum(-1).round().to(torch.int32))
                residual = residual - code * scale
            group_inds.append(torch.stack(inds, dim=-1))  # [B, T, R]
            group_margins.append(torch.stack(margins, dim=-1))
        codes = torch.cat(group_inds, dim=-1).transpose(1, 2)
        return codes, torch.cat(group_margins, dim=-1).transpose(1, 2)


class _ResidualFSQ(nn.Module):
    def __init__(self, dim: int, codebook_dim: int) -> None:
        super().__init__()
        self.project_in = nn.Linear(dim, codebook_dim)
        self.project_out = nn.Linear(codebook_dim, dim)


class DVAE(nn.Module):
    """Codes [B, 4, T] -> log-mel [B, 100, 2T]; and 24 kHz audio -> codes (speaker from audio)."""

    def __init__(self, cfg: DVAEConfig) -> None:
        super().__init__()
        self.register_buffer("coef", torch.ones(1, NUM_MELS, 1))
        self.downsample_conv = nn.Sequential(
            nn.Conv1d(NUM_MELS, cfg.dim, 3, 1, 1),
            nn.GELU(),
            nn.Conv1d(cfg.dim, cfg.dim, 4, 2, 1),
            nn.GELU(),
        )
        self.preprocessor_mel = MelBuffers()
        self.encoder = ConvStack(cfg.encoder)
        self.decoder = ConvStack(cfg.decoder)
        self.out_conv = nn.Conv1d(cfg.dim, NUM_MELS, 3, 1, 1, bias=False)
        self.vq_layer = nn.Module()
        self.vq_layer.quantizer = GFSQ(cfg)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        feats = self.vq_layer.quantizer.dequantize(codes)
        return self.out_conv(self.decoder(expand_frames(feats))) * self.coef

    def encode(self, wav: torch.Tensor) -> torch.Tensor:
        """1-D 24 kHz waveform -> codes [4, floor((1 + len // 256) / 2)] int32."""
        return self.encode_with_margin(wav)[0]

    def encode_with_margin(self, wav: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``encode`` plus each code's rounding margin (see ``GFSQ.quantize_with_margin``)."""
        if wav.dim() != 1:
            raise ValueError(f"expected a 1-D waveform, got shape {tuple(wav.shape)}")
        spec = self.preprocessor_mel.mel_spec
        mel = log_mel_spectrogram(wav, spec.spectrogram.window, spec.mel_scale.fb, floor=1e-5)
        x = self.downsample_conv(mel / self.coef.view(NUM_MELS, 1)).unsqueeze(0)
        codes, margin = self.vq_layer.quantizer.quantize_with_margin(self.encoder(x))
        return codes[0], margin[0]
