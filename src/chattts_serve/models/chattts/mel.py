"""Log-mel features with plain ``torch.stft`` (no torchaudio): 24 kHz, n_fft 1024, hop 256, magnitude
(power 1), HTK mel scale without norm, centred frames with reflect padding. Window and filterbank come
from the checkpoint; ``hann_window``/``mel_filterbank`` build them for ``random_checkpoint.write_random``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .config import HOP_LENGTH, N_FFT, NUM_MELS, SAMPLE_RATE


def hann_window(n_fft: int = N_FFT) -> torch.Tensor:
    return torch.hann_window(n_fft, periodic=True)


def _hz_to_mel(f: float) -> float:
    return 2595.0 * math.log10(1.0 + f / 700.0)


def _mel_to_hz(m: torch.Tensor) -> torch.Tensor:
    return 700.0 * (10.0 ** (m / 2595.0) - 1.0)


def mel_filterbank(
    n_freqs: int = N_FFT // 2 + 1,
    n_mels: int = NUM_MELS,
    sample_rate: int = SAMPLE_RATE,
    f_min: float = 0.0,
    f_max: float | None = None,
) -> torch.Tensor:
    """Triangular HTK filterbank [n_freqs, n_mels] (torchaudio ``melscale_fbanks``, norm=None)."""
    f_max = sample_rate / 2 if f_max is None else f_max
    all_freqs = torch.linspace(0, sample_rate // 2, n_freqs)
    m_pts = torch.linspace(_hz_to_mel(f_min), _hz_to_mel(f_max), n_mels + 2)
    f_pts = _mel_to_hz(m_pts)
    f_diff = f_pts[1:] - f_pts[:-1]
    slopes = f_pts.unsqueeze(0) - all_freqs.unsqueeze(1)
    down = (-1.0 * slopes[:, :-2]) / f_diff[:-1]
    up = slopes[:, 2:] / f_diff[1:]
    return torch.clamp(torch.minimum(down, up), min=0.0)


def log_mel_spectrogram(wav: torch.Tensor, window: torch.Tensor, fb: torch.Tensor, floor: float = 1e-5) -> torch.Tensor:
    """wav [..., L] -> ln(max(mel, floor)) [..., n_mels, 1 + L // hop]."""
    shape = wav.shape
    spec = torch.stft(
        wav.reshape(-1, shape[-1]),
        N_FFT,
        HOP_LENGTH,
        N_FFT,
        window.to(wav.device, wav.dtype),
        center=True,
        pad_mode="reflect",
        normalized=False,
        onesided=True,
        return_complex=True,
    ).abs()
    mel = torch.matmul(spec.transpose(-1, -2), fb.to(spec.dtype)).transpose(-1, -2)
    mel = mel.reshape(shape[:-1] + mel.shape[-2:])
    return torch.log(torch.clamp(mel, min=floor))


class MelBuffers(nn.Module):
    """The ``mel_spec.{spectrogram.window, mel_scale.fb}`` buffers that DVAE (``preprocessor_mel``) and
    Vocos (``feature_extractor``) carry in their checkpoints."""

    def __init__(self) -> None:
        super().__init__()
        self.mel_spec = nn.Module()
        self.mel_spec.spectrogram = nn.Module()
        self.mel_spec.mel_scale = nn.Module()
        self.mel_spec.spectrogram.register_buffer("window", torch.zeros(N_FFT))
        self.mel_spec.mel_scale.register_buffer("fb", torch.zeros(N_FFT // 2 + 1, NUM_MELS))
