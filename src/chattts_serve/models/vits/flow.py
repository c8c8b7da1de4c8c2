"""The prior's normalising flow (residual coupling layers over WaveNet stacks), run in reverse: prior sample ->
the decoder's latent. Batched over padded rows, masked as transformers masks it (its flow is batch-safe:
every convolution wider than 1 sees masked input), so a padded row computes what it computes alone.

The posterior encoder (training only: spectrogram -> latent) is defined for a strict load of its weights and
is dropped after loading.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import VitsConfig


class WNConv1d(nn.Conv1d):
    """A convolution the checkpoint stores as a weight-norm pair (``weight_g``/``weight_v``, or transformers 5's
    ``parametrizations.weight.original0/1``). Only a marker: the loader folds the pair into ``weight``."""


class WaveNet(nn.Module):
    def __init__(self, config: VitsConfig, num_layers: int):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_layers = num_layers
        self.in_layers = nn.ModuleList()
        self.res_skip_layers = nn.ModuleList()
        if config.speaker_embedding_size:
            self.cond_layer = WNConv1d(config.speaker_embedding_size, 2 * config.hidden_size * num_layers, 1)
        k = config.wavenet_kernel_size
        for i in range(num_layers):
            dilation = config.wavenet_dilation_rate**i
            self.in_layers.append(WNConv1d(config.hidden_size, 2 * config.hidden_size, k, dilation=dilation,
                                           padding=(k * dilation - dilation) // 2))
            out = 2 * config.hidden_size if i < num_layers - 1 else config.hidden_size
            self.res_skip_layers.append(WNConv1d(config.hidden_size, out, 1))

    def forward(self, x: torch.Tensor, mask: torch.Tensor, speaker: torch.Tensor | None = None) -> torch.Tensor:
        output = torch.zeros_like(x)
        conditioning = self.cond_layer(speaker) if speaker is not None else None
        h = self.hidden_size
        for i in range(self.num_layers):
            acts = self.in_layers[i](x)
            if conditioning is not None:
                acts = acts + conditioning[:, i * 2 * h : (i + 1) * 2 * h, :]
            acts = torch.tanh(acts[:, :h, :]) * torch.sigmoid(acts[:, h:, :])
            res_skip = self.res_skip_layers[i](acts)
            if i < self.num_layers - 1:
                x = (x + res_skip[:, :h, :]) * mask
                output = output + res_skip[:, h:, :]
            else:
                output = output + res_skip
        return output * mask


class ResidualCouplingLayer(nn.Module):
    def __init__(self, config: VitsConfig):
        super().__init__()
        self.half_channels = config.flow_size // 2
        self.conv_pre = nn.Conv1d(self.half_channels, config.hidden_size, 1)
        self.wavenet = WaveNet(config, num_layers=config.prior_encoder_num_wavenet_layers)
        self.conv_post = nn.Conv1d(config.hidden_size, self.half_channels, 1)

    def reverse(self, x: torch.Tensor, mask: torch.Tensor, speaker: torch.Tensor | None) -> torch.Tensor:
        first, second = torch.split(x, [self.half_channels] * 2, dim=1)
        h = self.conv_pre(first) * mask
        h = self.wavenet(h, mask, speaker)
        mean = self.conv_post(h) * mask
        # VITS's mean-only coupling: log_stddev is 0, so exp(-0) = 1 (transformers multiplies by it: exact).
        second = (second - mean) * mask
        return torch.cat([first, second], dim=1)


class ResidualCouplingBlock(nn.Module):
    def __init__(self, config: VitsConfig):
        super().__init__()
        self.flows = nn.ModuleList(ResidualCouplingLayer(config) for _ in range(config.prior_encoder_num_flows))

    def reverse(self, x: torch.Tensor, mask: torch.Tensor, speaker: torch.Tensor | None = None) -> torch.Tensor:
        for flow in reversed(self.flows):
            x = flow.reverse(torch.flip(x, [1]), mask, speaker)
        return x


class PosteriorEncoder(nn.Module):
    """Training only; its weights are in every checkpoint, so it is built for the strict load."""

    def __init__(self, config: VitsConfig):
        super().__init__()
        self.conv_pre = nn.Conv1d(config.spectrogram_bins, config.hidden_size, 1)
        self.wavenet = WaveNet(config, num_layers=config.posterior_encoder_num_wavenet_layers)
        self.conv_proj = nn.Conv1d(config.hidden_size, config.flow_size * 2, 1)
