"""Duration prediction: the stochastic duration predictor (a normalising flow run in reverse from noise, with
rational-quadratic spline couplings) and the deterministic predictor some VITS checkpoints use instead.

Like the text encoder, these run one utterance at a time with no padding (see ``text_encoder``), in
transformers' operation order, so a row's log-durations are transformers' at batch 1 bit for bit. Only the
inference direction is here; the training-only posterior half of the stochastic predictor (``post_*``) is
built so its weights load strictly, and never runs.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from .config import VitsConfig

MIN_BIN_WIDTH = MIN_BIN_HEIGHT = MIN_DERIVATIVE = 1e-3


class DepthSeparableConv(nn.Module):
    """Dilated depthwise convolutions (dilation k**i), each with a pointwise one, layer norms and GELUs."""

    def __init__(self, config: VitsConfig):
        super().__init__()
        k, channels = config.duration_predictor_kernel_size, config.hidden_size
        self.num_layers = config.depth_separable_num_layers
        self.convs_dilated = nn.ModuleList()
        self.convs_pointwise = nn.ModuleList()
        self.norms_1 = nn.ModuleList()
        self.norms_2 = nn.ModuleList()
        for i in range(self.num_layers):
            dilation = k**i
            self.convs_dilated.append(nn.Conv1d(channels, channels, k, groups=channels, dilation=dilation,
                                                padding=(k * dilation - dilation) // 2))
            self.convs_pointwise.append(nn.Conv1d(channels, channels, 1))
            self.norms_1.append(nn.LayerNorm(channels))
            self.norms_2.append(nn.LayerNorm(channels))

    def forward(self, x: torch.Tensor, conditioning: torch.Tensor | None = None) -> torch.Tensor:
        if conditioning is not None:
            x = x + conditioning
        for i in range(self.num_layers):
            h = self.convs_dilated[i](x)
            h = F.gelu(self.norms_1[i](h.transpose(1, -1)).transpose(1, -1))
            h = self.convs_pointwise[i](h)
            h = F.gelu(self.norms_2[i](h.transpose(1, -1)).transpose(1, -1))
            x = x + h
        return x


class ConvFlow(nn.Module):
    """A coupling layer: the first channel parameterises a monotone spline applied to the second."""

    def __init__(self, config: VitsConfig):
        super().__init__()
        self.filter_channels = config.hidden_size
        self.half_channels = config.depth_separable_channels // 2
        self.num_bins = config.duration_predictor_flow_bins
        self.tail_bound = config.duration_predictor_tail_bound
        self.conv_pre = nn.Conv1d(self.half_channels, self.filter_channels, 1)
        self.conv_dds = DepthSeparableConv(config)
        self.conv_proj = nn.Conv1d(self.filter_channels, self.half_channels * (self.num_bins * 3 - 1), 1)

    def reverse(self, x: torch.Tensor, conditioning: torch.Tensor) -> torch.Tensor:
        first, second = torch.split(x, [self.half_channels] * 2, dim=1)
        h = self.conv_dds(self.conv_pre(first), conditioning)
        h = self.conv_proj(h)
        batch, channels, length = first.shape
        h = h.reshape(batch, channels, -1, length).permute(0, 1, 3, 2)
        scale = math.sqrt(self.filter_channels)
        widths = h[..., : self.num_bins] / scale
        heights = h[..., self.num_bins : 2 * self.num_bins] / scale
        derivatives = h[..., 2 * self.num_bins :]
        second = unconstrained_spline_inverse(second, widths, heights, derivatives, self.tail_bound)
        return torch.cat([first, second], dim=1)


class ElementwiseAffine(nn.Module):
    def __init__(self, config: VitsConfig):
        super().__init__()
        self.translate = nn.Parameter(torch.zeros(config.depth_separable_channels, 1))
        self.log_scale = nn.Parameter(torch.zeros(config.depth_separable_channels, 1))

    def reverse(self, x: torch.Tensor, conditioning: torch.Tensor) -> torch.Tensor:
        return (x - self.translate) * torch.exp(-self.log_scale)


class StochasticDurationPredictor(nn.Module):
    def __init__(self, config: VitsConfig):
        super().__init__()
        channels = config.hidden_size
        self.conv_pre = nn.Conv1d(channels, channels, 1)
        self.conv_proj = nn.Conv1d(channels, channels, 1)
        self.conv_dds = DepthSeparableConv(config)
        if config.speaker_embedding_size:
            self.cond = nn.Conv1d(config.speaker_embedding_size, channels, 1)
        self.flows = nn.ModuleList([ElementwiseAffine(config)]
                                   + [ConvFlow(config) for _ in range(config.duration_predictor_num_flows)])
        # Training only (the posterior over durations); here for a strict load.
        self.post_conv_pre = nn.Conv1d(1, channels, 1)
        self.post_conv_proj = nn.Conv1d(channels, channels, 1)
        self.post_conv_dds = DepthSeparableConv(config)
        self.post_flows = nn.ModuleList([ElementwiseAffine(config)]
                                        + [ConvFlow(config) for _ in range(config.duration_predictor_num_flows)])

    def forward(self, hidden: torch.Tensor, noise: torch.Tensor, speaker: torch.Tensor | None = None) -> torch.Tensor:
        """``hidden`` [1, H, L], ``noise`` [1, 2, L] (already scaled by noise_scale_duration) -> log-durations
        [1, 1, L]."""
        x = self.conv_pre(hidden)
        if speaker is not None:
            x = x + self.cond(speaker)
        x = self.conv_proj(self.conv_dds(x))
        flows = list(reversed(self.flows))
        flows = flows[:-2] + [flows[-1]]  # as VITS: the first conv flow is skipped in reverse
        latents = noise
        for flow in flows:
            latents = flow.reverse(torch.flip(latents, [1]), x)
        log_duration, _ = torch.split(latents, [1, 1], dim=1)
        return log_duration


class DurationPredictor(nn.Module):
    """The deterministic predictor (``use_stochastic_duration_prediction: false``)."""

    def __init__(self, config: VitsConfig):
        super().__init__()
        k, filters = config.duration_predictor_kernel_size, config.duration_predictor_filter_channels
        self.conv_1 = nn.Conv1d(config.hidden_size, filters, k, padding=k // 2)
        self.norm_1 = nn.LayerNorm(filters, eps=config.layer_norm_eps)
        self.conv_2 = nn.Conv1d(filters, filters, k, padding=k // 2)
        self.norm_2 = nn.LayerNorm(filters, eps=config.layer_norm_eps)
        self.proj = nn.Conv1d(filters, 1, 1)
        if config.speaker_embedding_size:
            self.cond = nn.Conv1d(config.speaker_embedding_size, config.hidden_size, 1)

    def forward(self, hidden: torch.Tensor, speaker: torch.Tensor | None = None) -> torch.Tensor:
        x = hidden
        if speaker is not None:
            x = x + self.cond(speaker)
        x = self.norm_1(torch.relu(self.conv_1(x)).transpose(1, -1)).transpose(1, -1)
        x = self.norm_2(torch.relu(self.conv_2(x)).transpose(1, -1)).transpose(1, -1)
        return self.proj(x)


def unconstrained_spline_inverse(inputs: torch.Tensor, widths: torch.Tensor, heights: torch.Tensor,
                                 derivatives: torch.Tensor, tail_bound: float) -> torch.Tensor:
    """The inverse of a monotone rational-quadratic spline on [-tail_bound, tail_bound], identity outside."""
    inside = (inputs >= -tail_bound) & (inputs <= tail_bound)
    outputs = torch.zeros_like(inputs)
    constant = np.log(np.exp(1 - MIN_DERIVATIVE) - 1)
    derivatives = F.pad(derivatives, pad=(1, 1))
    derivatives[..., 0] = constant
    derivatives[..., -1] = constant
    outputs[~inside] = inputs[~inside]
    outputs[inside] = _spline_inverse(inputs[inside], widths[inside, :], heights[inside, :], derivatives[inside, :],
                                      tail_bound)
    return outputs


def _spline_inverse(inputs: torch.Tensor, unnormalized_widths: torch.Tensor, unnormalized_heights: torch.Tensor,
                    unnormalized_derivatives: torch.Tensor, tail_bound: float) -> torch.Tensor:
    """Solve the spline's quadratic for the input that maps to ``inputs`` (the reverse pass of the flow)."""
    lower, upper = -tail_bound, tail_bound
    num_bins = unnormalized_widths.shape[-1]
    widths = F.softmax(unnormalized_widths, dim=-1)
    widths = MIN_BIN_WIDTH + (1 - MIN_BIN_WIDTH * num_bins) * widths
    cumwidths = F.pad(torch.cumsum(widths, dim=-1), pad=(1, 0), mode="constant", value=0.0)
    cumwidths = (upper - lower) * cumwidths + lower
    cumwidths[..., 0] = lower
    cumwidths[..., -1] = upper
    widths = cumwidths[..., 1:] - cumwidths[..., :-1]
    derivatives = MIN_DERIVATIVE + F.softplus(unnormalized_derivatives)
    heights = F.softmax(unnormalized_heights, dim=-1)
    heights = MIN_BIN_HEIGHT + (1 - MIN_BIN_HEIGHT * num_bins) * heights
    cumheights = F.pad(torch.cumsum(heights, dim=-1), pad=(1, 0), mode="constant", value=0.0)
    cumheights = (upper - lower) * cumheights + lower
    cumheights[..., 0] = lower
    cumheights[..., -1] = upper
    heights = cumheights[..., 1:] - cumheights[..., :-1]

    cumheights[..., -1] += 1e-6  # the bin search's locations (transformers shifts the last edge in place)
    bin_idx = (torch.sum(inputs[..., None] >= cumheights, dim=-1) - 1)[..., None]
    input_cumwidths = cumwidths.gather(-1, bin_idx)[..., 0]
    input_bin_widths = widths.gather(-1, bin_idx)[..., 0]
    input_cumheights = cumheights.gather(-1, bin_idx)[..., 0]
    delta = heights / widths
    input_delta = delta.gather(-1, bin_idx)[..., 0]
    input_derivatives = derivatives.gather(-1, bin_idx)[..., 0]
    input_derivatives_plus_one = derivatives[..., 1:].gather(-1, bin_idx)[..., 0]
    input_heights = heights.gather(-1, bin_idx)[..., 0]

    intermediate1 = input_derivatives + input_derivatives_plus_one - 2 * input_delta
    intermediate2 = inputs - input_cumheights
    intermediate3 = intermediate2 * intermediate1
    a = input_heights * (input_delta - input_derivatives) + intermediate3
    b = input_heights * input_derivatives - intermediate3
    c = -input_delta * intermediate2
    discriminant = b.pow(2) - 4 * a * c
    root = (2 * c) / (-b - torch.sqrt(discriminant))
    return root * input_bin_widths + input_cumwidths
