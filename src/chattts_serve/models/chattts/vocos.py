"""Vocos vocoder: log-mel [B, 100, F] -> 24 kHz waveform [B, 256 * (F - 1)].

Names follow ``asset/Vocos.safetensors`` (``backbone.*``, ``head.*``). ConvNeXt backbone, then an
ISTFT head (513 log-magnitudes + 513 phases per frame) with centred frames.

The inverse STFT is ``torch.istft``'s own sequence of ops (irfft, window, ``unfold_backward`` as the
overlap-add, division by the overlap-added squared window), bit-identical to it on the CPU, without
its NOLA check: that check reads a device value on the host (``.item()``), a sync per call on CUDA
that would stop an audio decode overlapping the next GPT step. The periodic Hann window at hop
N_FFT / 4 satisfies NOLA for any frame count, so the check can never fail here.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import HOP_LENGTH, N_FFT, NUM_MELS, VocosConfig
from .dvae import ConvNeXtBlock
from .mel import MelBuffers, hann_window

_ENVELOPES_KEPT = 32


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


def _overlap_add(frames: torch.Tensor, length: int) -> torch.Tensor:
    """[B, F, N] -> [B, length]: frame f added at samples [f * HOP_LENGTH, f * HOP_LENGTH + N); the
    op (and so the summation order) ``torch.istft`` uses."""
    return torch.ops.aten.unfold_backward(frames, [frames.shape[0], length], 1, frames.shape[2], HOP_LENGTH)


def window_envelope(window: torch.Tensor, num_frames: int) -> torch.Tensor:
    """The overlap-added squared window of ``num_frames`` frames, [1, N + HOP * (F - 1)]: what each
    sample of the overlap-add is divided by."""
    n = window.shape[0]
    return _overlap_add(window.pow(2).expand(1, num_frames, n), n + HOP_LENGTH * (num_frames - 1))


def istft(
    spec: torch.Tensor, window: torch.Tensor, envelope: torch.Tensor | None = None, frames: torch.Tensor | None = None
) -> torch.Tensor:
    """Complex one-sided STFT [B, N/2 + 1, F] -> waveform [B, HOP * (F - 1)], as
    ``torch.istft(spec, N, HOP, N, window, center=True)`` with no host sync.

    ``envelope``: ``window_envelope(window, F)``, precomputed (computed here when None).
    ``frames``: [B] long, each row's true frame count when rows are right-padded to F: the padding
    frames are dropped and a row is normalised by its own frames' envelope, so its first
    ``HOP * (frames - 1)`` samples are those of the row alone (the caller trims the rest)."""
    n = window.shape[0]
    num_frames = spec.shape[2]
    length = n + HOP_LENGTH * (num_frames - 1)
    y = torch.fft.irfft(spec.transpose(1, 2), n, dim=-1) * window  # [B, F, N]
    if frames is None:
        env = window_envelope(window, num_frames) if envelope is None else envelope
    else:
        keep = (torch.arange(num_frames, device=spec.device) < frames[:, None])[..., None]  # [B, F, 1]
        y = y.masked_fill(~keep, 0.0)
        env = _overlap_add(window.pow(2) * keep, length)
        env = torch.where(env > 0, env, 1.0)  # past a row's last frame only (y is 0 there)
    return (_overlap_add(y, length) / env)[:, n // 2 : length - n // 2]


def spectrum_of_projection(x: torch.Tensor) -> torch.Tensor:
    """The head's projection [B, F, N + 2] (log-magnitudes, then phases) -> complex STFT [B, N/2 + 1, F]
    in fp32. Apart from ``ISTFTHead`` so a runtime that ran the convolutions up to the projection
    (``audio.cpu_graph``) finishes the same way."""
    x = x.float().transpose(1, 2)
    log_mag, phase = x.chunk(2, dim=1)
    mag = torch.clip(torch.exp(log_mag), max=1e2)
    return mag * (torch.cos(phase) + 1j * torch.sin(phase))


class ISTFTHead(nn.Module):
    def __init__(self, cfg: VocosConfig) -> None:
        super().__init__()
        self.out = nn.Linear(cfg.dim, N_FFT + 2)
        self.istft = nn.Module()
        self.istft.register_buffer("window", hann_window(N_FFT))
        self._envelopes: dict[tuple[int, torch.device, torch.dtype], torch.Tensor] = {}

    def spectrum(self, x: torch.Tensor) -> torch.Tensor:
        """[B, F, dim] -> complex STFT [B, 513, F], in fp32 (a no-op in fp32; under bf16 autocast the
        projection's output is upcast once: there is no bf16 complex FFT)."""
        return spectrum_of_projection(self.out(x))

    def envelope(self, num_frames: int) -> torch.Tensor:
        """``window_envelope`` of ``num_frames`` frames, kept for the most recent lengths (window
        buckets repeat a few lengths)."""
        window = self.istft.window
        key = (num_frames, window.device, window.dtype)
        env = self._envelopes.get(key)
        if env is None:
            if len(self._envelopes) >= _ENVELOPES_KEPT:
                self._envelopes.pop(next(iter(self._envelopes)))
            env = self._envelopes[key] = window_envelope(window, num_frames)
        return env

    def forward(self, x: torch.Tensor, frames: torch.Tensor | None = None) -> torch.Tensor:
        """[B, F, dim] -> waveform [B, 256 * (F - 1)]; ``frames``: see ``istft``."""
        spec = self.spectrum(x)
        window = self.istft.window
        if frames is not None:
            return istft(spec, window, frames=frames)
        return istft(spec, window, self.envelope(spec.shape[2]))


class Vocos(nn.Module):
    def __init__(self, cfg: VocosConfig) -> None:
        super().__init__()
        self.feature_extractor = MelBuffers()
        self.backbone = Backbone(cfg)
        self.head = ISTFTHead(cfg)

    def forward(self, mel: torch.Tensor, frames: torch.Tensor | None = None) -> torch.Tensor:
        """``frames``: each row's true frame count when ``mel`` is right-padded (see ``istft``); the
        backbone's convolutions must then see zeros past it (``audio.decode`` masks them)."""
        return self.head(self.backbone(mel), frames)
