"""The decoder: style-conditioned residual blocks, then the iSTFTNet generator with its sine source.

The generator predicts a small spectrogram (``gen_istft_n_fft`` bins, hop ``gen_istft_hop_size``) and
turns it into audio with an inverse STFT. Its harmonic source is a sum of sines at F0 and its overtones,
plus noise: the only random draws in the model. Each utterance draws from its own ``torch.Generator`` in
the order and shapes the package draws from the global one at batch 1, so a seeded row reproduces the
package's ``torch.manual_seed(s)`` run whatever batch it is in.

The STFT and inverse STFT are centred (reflect-padded) per row, so they run row by row on each row's
own samples: they are tiny next to the convolutions, and a padded batch would reflect padding in.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from .blocks import AdainResBlk1d, AdaINResBlock1
from .config import (
    HARMONICS,
    NOISE_STD,
    SAMPLE_RATE,
    SINE_AMP,
    VOICED_THRESHOLD,
    IstftnetConfig,
)
from .layers import Lengths, WNConv1d, WNConvTranspose1d, masked


class SineSource(nn.Module):
    """F0 -> one harmonic excitation: 9 sines (F0 and 8 overtones) with noise, merged by a linear + tanh.

    Holds the official ``m_source.l_linear``. ``f0`` is [B, L] at the audio rate; row ``b`` is valid for
    ``lengths[b]`` samples and draws its noise from ``generators[b]``.
    """

    def __init__(self, upsample_scale: int):
        super().__init__()
        self.upsample_scale = upsample_scale
        self.dim = HARMONICS + 1
        self.l_linear = nn.Linear(self.dim, 1)

    def forward(self, f0: torch.Tensor, lengths: Lengths, generators: list[torch.Generator | None]) -> torch.Tensor:
        """[B, L] excitation, zero past each row's end.

        Row by row, on each row's own samples: the source is cheap (elementwise over 9 sines), and its
        output feeds an STFT whose phases (``angle``) jump by 2*pi on a 1-ulp change of a near-silent
        bin, so it must be each row's batch-1 value exactly, not merely close (a batched linear layer or
        a vector loop's tail changes the last bit).
        """
        out = torch.zeros_like(f0)
        for row, (n, gen) in enumerate(zip(lengths.lengths.tolist(), generators, strict=True)):
            out[row, :n] = self._one(f0[row : row + 1, :n], gen)[0]
        return out

    def _one(self, f0: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
        """One utterance's source [1, n] from its F0 [1, n] at the audio rate, as the package computes it."""
        n = f0.shape[1]
        harmonics = torch.arange(1, self.dim + 1, dtype=torch.float32, device=f0.device)
        rad = (f0[:, :, None] * harmonics[None, None, :] / SAMPLE_RATE) % 1
        # The reference's three draws, in its order: the initial phases (none for the fundamental), the
        # additive noise, then the noise branch's draw, which the generator never uses: drawn anyway so a
        # generator is left where the package leaves the global one. The additive noise is ``randn_like``
        # of a harmonics-major tensor seen as [1, n, 9]: a non-contiguous fill, which torch draws element
        # by element (not in its vectorised blocks of 16) in memory order; filling a tensor of that same
        # layout reproduces it.
        initial = torch.rand((1, self.dim), generator=gen, device=f0.device)
        noise = torch.empty(1, self.dim, n, device=f0.device).transpose(1, 2).normal_(generator=gen)
        torch.empty(1, n, 1, device=f0.device).normal_(generator=gen)
        initial[:, 0] = 0
        rad[:, 0, :] = rad[:, 0, :] + initial
        # Phase: integrate at the F0 rate (the signal is constant over each F0 step), then interpolate
        # back up; written as the reference writes it, so the rounding matches.
        rad = F.interpolate(rad.transpose(1, 2), scale_factor=1 / self.upsample_scale, mode="linear")
        phase = torch.cumsum(rad, dim=2) * 2 * torch.pi
        phase = F.interpolate(phase * self.upsample_scale, scale_factor=self.upsample_scale, mode="linear")
        sines = torch.sin(phase.transpose(1, 2)) * SINE_AMP
        uv = (f0[:, :, None] > VOICED_THRESHOLD).type(torch.float32)
        noise_amp = uv * NOISE_STD + (1 - uv) * SINE_AMP / 3
        sines = sines * uv + noise_amp * noise
        return torch.tanh(self.l_linear(sines))[:, :, 0]


class Generator(nn.Module):
    def __init__(self, style_dim: int, cfg: IstftnetConfig):
        super().__init__()
        self.n_fft = cfg.gen_istft_n_fft
        self.hop = cfg.gen_istft_hop_size
        self.rates = cfg.upsample_rates
        self.num_kernels = len(cfg.resblock_kernel_sizes)
        self.upsample_scale = cfg.upsample_scale
        self.m_source = SineSource(self.upsample_scale)
        # Registered in the official order, so a state dict we write lists its keys as the package's does.
        self.noise_convs = nn.ModuleList()
        self.noise_res = nn.ModuleList()
        self.ups = nn.ModuleList()
        self.resblocks = nn.ModuleList()
        ch = cfg.upsample_initial_channel
        for i, (u, k) in enumerate(zip(cfg.upsample_rates, cfg.upsample_kernel_sizes, strict=True)):
            self.ups.append(WNConvTranspose1d(ch // 2**i, ch // 2 ** (i + 1), k, u, padding=(k - u) // 2))
        for i in range(len(self.ups)):
            c = ch // 2 ** (i + 1)
            for k, d in zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes, strict=True):
                self.resblocks.append(AdaINResBlock1(c, k, tuple(d), style_dim))
            if i + 1 < len(cfg.upsample_rates):
                stride = math.prod(cfg.upsample_rates[i + 1 :])
                self.noise_convs.append(nn.Conv1d(self.n_fft + 2, c, kernel_size=stride * 2, stride=stride,
                                                  padding=(stride + 1) // 2))
                self.noise_res.append(AdaINResBlock1(c, 7, (1, 3, 5), style_dim))
            else:
                self.noise_convs.append(nn.Conv1d(self.n_fft + 2, c, kernel_size=1))
                self.noise_res.append(AdaINResBlock1(c, 11, (1, 3, 5), style_dim))
        self.conv_post = WNConv1d(c, self.n_fft + 2, 7, 1, padding=3)
        self.register_buffer("window", torch.hann_window(self.n_fft, periodic=True, dtype=torch.float32),
                             persistent=False)

    def forward(self, x: torch.Tensor, style: torch.Tensor, f0: torch.Tensor, lengths: Lengths,
                generators: list[torch.Generator | None]) -> list[torch.Tensor]:
        """``x`` [B, C, T] and ``f0`` [B, T] at ``lengths`` -> one waveform per row."""
        har = self.harmonics(f0, lengths, generators)
        return self.waveforms(self.spectra(x, style, har, lengths), self.spectrum_lengths(lengths))

    def harmonics(self, f0: torch.Tensor, lengths: Lengths, generators: list[torch.Generator | None]
                  ) -> torch.Tensor:
        """The source's spectra [B, n_fft + 2, frames] (magnitude and phase, zero past each row's end) from
        ``f0`` [B, T] at ``lengths``: the model's random draws, and per-row STFTs; outside any CUDA graph."""
        samples = lengths.scaled(self.upsample_scale)
        f0_audio = F.interpolate(f0[:, None, :], scale_factor=self.upsample_scale, mode="nearest")[:, 0, :]
        source = self.m_source(f0_audio, samples, generators)
        har = torch.zeros(f0.shape[0], self.n_fft + 2, samples.total // self.hop + 1, device=f0.device)
        for row, n in enumerate(samples.lengths.tolist()):
            har[row, :, : n // self.hop + 1] = self._analyse(source[row, :n])
        return har

    def spectrum_lengths(self, lengths: Lengths) -> Lengths:
        """The rows' lengths at the predicted spectrogram's rate (what ``spectra`` returns)."""
        for i, rate in enumerate(self.rates):
            lengths = lengths.scaled(rate, extra=1 if i == len(self.rates) - 1 else 0)
        return lengths

    def spectra(self, x: torch.Tensor, style: torch.Tensor, har: torch.Tensor, lengths: Lengths) -> torch.Tensor:
        """The predicted log-magnitudes and phases [B, n_fft + 2, frames] (the convolutions: no host value when
        ``lengths`` is a ``DeviceLengths``, so a CUDA graph can capture it)."""
        at = lengths
        for i, rate in enumerate(self.rates):
            x = F.leaky_relu(x, negative_slope=0.1)
            last = i == len(self.rates) - 1
            # The source enters at every stage, strided down to that stage's rate (the last stage runs at
            # the spectrogram's frame rate: one more frame than the upsampled signal, hence the pad).
            x_at = at.scaled(rate, extra=1 if last else 0)
            x_source = self.noise_res[i](masked(self.noise_convs[i](har), x_at), style, x_at)
            x = self.ups[i](masked(x, at))
            if last:
                x = F.pad(x, (1, 0), mode="reflect")
            at = x_at
            x = masked(x, at) + x_source
            xs = None
            for j in range(self.num_kernels):
                y = self.resblocks[i * self.num_kernels + j](x, style, at)
                xs = y if xs is None else xs + y
            x = xs / self.num_kernels
        return self.conv_post(masked(F.leaky_relu(x), at))

    def waveforms(self, x: torch.Tensor, at: Lengths) -> list[torch.Tensor]:
        """One waveform per row from ``spectra``'s output at ``at`` (host lengths): per-row inverse STFTs."""
        return [self._synthesise(x[row : row + 1, :, :n]) for row, n in enumerate(at.lengths.tolist())]

    def _analyse(self, signal: torch.Tensor) -> torch.Tensor:
        spec = torch.stft(signal[None], self.n_fft, self.hop, self.n_fft, window=self.window, return_complex=True)
        return torch.cat([torch.abs(spec), torch.angle(spec)], dim=1)[0]

    def _synthesise(self, x: torch.Tensor) -> torch.Tensor:
        bins = self.n_fft // 2 + 1
        spec = torch.exp(x[:, :bins, :])
        phase = torch.sin(x[:, bins:, :])
        return torch.istft(spec * torch.exp(phase * 1j), self.n_fft, self.hop, self.n_fft, window=self.window)[0]


class Decoder(nn.Module):
    def __init__(self, dim_in: int, style_dim: int, cfg: IstftnetConfig, width: int, asr_res: int):
        """``dim_in``: the ASR features' width (``hidden_dim``); ``width`` and ``asr_res``: the blocks' and the
        ASR residual's widths (``decoder_dim``, ``asr_res_dim``: 1024 and 64 in the official model)."""
        super().__init__()
        side = 2 + asr_res  # F0, energy and the ASR residual ride along into every decode block
        out = cfg.upsample_initial_channel
        self.encode = AdainResBlk1d(dim_in + 2, width, style_dim)
        self.decode = nn.ModuleList([
            AdainResBlk1d(width + side, width, style_dim),
            AdainResBlk1d(width + side, width, style_dim),
            AdainResBlk1d(width + side, width, style_dim),
            AdainResBlk1d(width + side, out, style_dim, upsample=True),
        ])
        self.F0_conv = WNConv1d(1, 1, kernel_size=3, stride=2, groups=1, padding=1)
        self.N_conv = WNConv1d(1, 1, kernel_size=3, stride=2, groups=1, padding=1)
        self.asr_res = nn.Sequential(WNConv1d(dim_in, asr_res, kernel_size=1))
        self.generator = Generator(style_dim, cfg)

    def forward(self, asr: torch.Tensor, f0: torch.Tensor, energy: torch.Tensor, style: torch.Tensor,
                frames: Lengths, generators: list[torch.Generator | None]) -> list[torch.Tensor]:
        """``asr`` [B, C, F] at ``frames``; ``f0``/``energy`` [B, 2F] (zero past each row's end)."""
        at = frames.scaled(2)  # the decode blocks double the rate once
        har = self.generator.harmonics(f0, at, generators)
        spectra = self.spectra(asr, f0, energy, style, frames, har)
        return self.generator.waveforms(spectra, self.generator.spectrum_lengths(at))

    def spectra(self, asr: torch.Tensor, f0: torch.Tensor, energy: torch.Tensor, style: torch.Tensor,
                frames: Lengths, har: torch.Tensor) -> torch.Tensor:
        """Everything between the source's spectra ``har`` (``Generator.harmonics``) and the inverse STFTs: the
        part of the decoder a CUDA graph captures per bucket (``models.kokoro.graphs``)."""
        f0_down = masked(self.F0_conv(f0[:, None, :]), frames)
        energy_down = masked(self.N_conv(energy[:, None, :]), frames)
        x = self.encode(torch.cat([asr, f0_down, energy_down], dim=1), style, frames)
        asr_res = masked(self.asr_res(asr), frames)
        at = frames
        for block in self.decode:
            if at is frames:  # the side inputs ride along until the rate doubles (after the last block)
                x = torch.cat([x, asr_res, f0_down, energy_down], dim=1)
            x = block(x, style, at)
            at = at.scaled(2) if block.upsample else at
        return self.generator.spectra(x, style, har, at)
