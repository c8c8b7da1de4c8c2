"""The two style-conditioned residual blocks shared by the prosody predictor and the decoder.

Every block takes and returns a padded [B, C, T] batch whose padding is zero, with the rows' valid
lengths at the input rate (:class:`Lengths`); a block that doubles the rate says so.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .layers import Lengths, StyledInstanceNorm, WNConv1d, WNConvTranspose1d, masked

_INV_SQRT2 = torch.rsqrt(torch.tensor(2))  # the reference scales the residual sum by this float32 value


class AdainResBlk1d(nn.Module):
    """AdaIN -> LeakyReLU(0.2) -> [x2 depthwise transposed conv] -> conv3 -> AdaIN -> LeakyReLU -> conv3,
    added to a (nearest x2, 1x1-projected) shortcut and scaled by 1/sqrt(2)."""

    def __init__(self, dim_in: int, dim_out: int, style_dim: int, upsample: bool = False):
        super().__init__()
        self.upsample = upsample
        self.conv1 = WNConv1d(dim_in, dim_out, 3, 1, 1)
        self.conv2 = WNConv1d(dim_out, dim_out, 3, 1, 1)
        self.norm1 = StyledInstanceNorm(style_dim, dim_in)
        self.norm2 = StyledInstanceNorm(style_dim, dim_out)
        self.learned_sc = dim_in != dim_out
        if self.learned_sc:
            self.conv1x1 = WNConv1d(dim_in, dim_out, 1, 1, 0, bias=False)
        if upsample:
            self.pool = WNConvTranspose1d(dim_in, dim_in, kernel_size=3, stride=2, groups=dim_in, padding=1,
                                          output_padding=1)

    def forward(self, x: torch.Tensor, style: torch.Tensor, lengths: Lengths) -> torch.Tensor:
        """``x`` at ``lengths``; the result is at ``lengths.scaled(2)`` when the block upsamples."""
        out_lengths = lengths.scaled(2) if self.upsample else lengths
        shortcut = F.interpolate(x, scale_factor=2, mode="nearest") if self.upsample else x
        if self.learned_sc:
            shortcut = self.conv1x1(shortcut)
        h = F.leaky_relu(self.norm1(x, style, lengths), 0.2, inplace=True)
        if self.upsample:
            h = self.pool(masked(h, lengths))
        h = self.conv1(masked(h, out_lengths))
        h = F.leaky_relu(self.norm2(h, style, out_lengths), 0.2, inplace=True)
        h = self.conv2(masked(h, out_lengths))
        return masked(h.add_(shortcut).mul_(_INV_SQRT2), out_lengths)


def _snake(x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """Snake activation x + sin^2(a x) / a, with the reference's roundings (``** 2`` is a square; a product and a
    sum are the same whichever side each operand is on), in place on one buffer: the generator runs it on
    [128, 36000] tensors 18 times an utterance, where a fresh buffer per operation cost more than the sine
    (1.6x faster, bit for bit the reference's)."""
    h = torch.mul(alpha, x)
    h.sin_()
    h.square_()
    h.mul_(1 / alpha)
    return h.add_(x)


def norm_snake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor,
               alpha: torch.Tensor, dtype: torch.dtype, eps: float = 1e-5) -> torch.Tensor:
    """AdaIN then snake, for one row-uniform batch, cast to the next convolution's ``dtype``: what
    ``KokoroModel.compile_decoder`` compiles into one pass (eagerly it is five passes and three buffers)."""
    mean = x.mean(dim=2, keepdim=True)
    var = x.var(dim=2, keepdim=True, unbiased=False)
    h = (x - mean) * torch.rsqrt(var + eps) * weight[None, :, None] + bias[None, :, None]
    h = (1 + gamma) * h + beta
    return (h + (1 / alpha) * torch.sin(alpha * h) ** 2).to(dtype)


class AdaINResBlock1(nn.Module):
    """The generator's multi-receptive-field block: per dilation, AdaIN -> snake -> dilated conv ->
    AdaIN -> snake -> conv, added back to the input. ``fused`` (``KokoroModel.compile_decoder``): a compiled
    ``norm_snake`` that runs AdaIN and snake in one pass where no row is padded (not the reference's roundings)."""

    fused = None

    def __init__(self, channels: int, kernel_size: int, dilations: tuple[int, ...], style_dim: int):
        super().__init__()
        self.convs1 = nn.ModuleList([
            WNConv1d(channels, channels, kernel_size, 1, dilation=d, padding=d * (kernel_size - 1) // 2)
            for d in dilations
        ])
        self.convs2 = nn.ModuleList([
            WNConv1d(channels, channels, kernel_size, 1, dilation=1, padding=(kernel_size - 1) // 2)
            for _ in dilations
        ])
        self.adain1 = nn.ModuleList([StyledInstanceNorm(style_dim, channels) for _ in dilations])
        self.adain2 = nn.ModuleList([StyledInstanceNorm(style_dim, channels) for _ in dilations])
        self.alpha1 = nn.ParameterList([nn.Parameter(torch.ones(1, channels, 1)) for _ in dilations])
        self.alpha2 = nn.ParameterList([nn.Parameter(torch.ones(1, channels, 1)) for _ in dilations])

    def forward(self, x: torch.Tensor, style: torch.Tensor, lengths: Lengths) -> torch.Tensor:
        for c1, c2, n1, n2, a1, a2 in zip(self.convs1, self.convs2, self.adain1, self.adain2, self.alpha1,
                                          self.alpha2, strict=True):
            if self.fused is not None and not lengths.ragged:
                h = c1(self._fused(x, style, n1, a1, c1.weight.dtype))
                h = c2(self._fused(h, style, n2, a2, c2.weight.dtype))
                x = h.add_(x)
                continue
            h = c1(masked(_snake(n1(x, style, lengths), a1), lengths))
            h = c2(masked(_snake(n2(h, style, lengths), a2), lengths))
            x = masked(h.add_(x), lengths)
        return x

    def _fused(self, x, style, norm, alpha, dtype):
        gamma, beta = torch.chunk(norm.fc(style)[:, :, None], chunks=2, dim=1)
        return self.fused(x, norm.norm.weight, norm.norm.bias, gamma, beta, alpha, dtype)
