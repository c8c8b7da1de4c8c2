"""The text encoder: token embeddings through a Transformer with windowed relative-position attention, then the
prior's per-token means and log-variances.

It runs one utterance at a time (``VitsModel`` loops over the batch's rows): the text side is a small part of
the cost, and alone a row computes exactly what transformers computes at batch 1 (the same kernels on the same
shapes), which keeps durations bit-exact and batch-invariant. So there is no padding here and no mask.
The operations and their order are transformers' ``VitsTextEncoder`` (fp32 bit-exactness depends on it).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from .config import VitsConfig


class RelativeAttention(nn.Module):
    def __init__(self, config: VitsConfig):
        super().__init__()
        dim = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.scaling = self.head_dim**-0.5
        self.window_size = config.window_size
        self.k_proj = nn.Linear(dim, dim, bias=config.use_bias)
        self.v_proj = nn.Linear(dim, dim, bias=config.use_bias)
        self.q_proj = nn.Linear(dim, dim, bias=config.use_bias)
        self.out_proj = nn.Linear(dim, dim, bias=config.use_bias)
        if self.window_size:
            self.emb_rel_k = nn.Parameter(torch.zeros(1, 2 * self.window_size + 1, self.head_dim))
            self.emb_rel_v = nn.Parameter(torch.zeros(1, 2 * self.window_size + 1, self.head_dim))

    def _heads(self, x: torch.Tensor, length: int) -> torch.Tensor:
        return x.view(1, length, self.num_heads, self.head_dim).transpose(1, 2).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, length, dim = x.shape
        shape = (self.num_heads, -1, self.head_dim)
        query = self._heads(self.q_proj(x) * self.scaling, length).view(*shape)
        key = self._heads(self.k_proj(x), length).view(*shape)
        value = self._heads(self.v_proj(x), length).view(*shape)
        weights = torch.bmm(query, key.transpose(1, 2))
        if self.window_size:
            rel_k = self._relative_embeddings(self.emb_rel_k, length)
            weights += _relative_to_absolute(torch.matmul(query, rel_k.transpose(-2, -1)))
        probs = F.softmax(weights, dim=-1)
        out = torch.bmm(probs, value)
        if self.window_size:
            rel_v = self._relative_embeddings(self.emb_rel_v, length)
            out += torch.matmul(_absolute_to_relative(probs), rel_v)
        out = out.view(1, self.num_heads, length, self.head_dim).transpose(1, 2).reshape(1, length, dim)
        return self.out_proj(out)

    def _relative_embeddings(self, table: torch.Tensor, length: int) -> torch.Tensor:
        """The rows of ``table`` for offsets -(length-1)..length-1 (zeros beyond the window)."""
        pad = max(length - (self.window_size + 1), 0)
        if pad > 0:
            table = F.pad(table, [0, 0, pad, pad, 0, 0])
        start = max((self.window_size + 1) - length, 0)
        return table[:, start : start + 2 * length - 1]


def _relative_to_absolute(x: torch.Tensor) -> torch.Tensor:
    """[heads, L, 2L-1] logits by offset -> [heads, L, L] by key position (the pad-and-reshape skew)."""
    heads, length, _ = x.shape
    x = F.pad(x, [0, 1, 0, 0, 0, 0]).view(heads, length * 2 * length)
    x = F.pad(x, [0, length - 1, 0, 0]).view(heads, length + 1, 2 * length - 1)
    return x[:, :length, length - 1 :]


def _absolute_to_relative(x: torch.Tensor) -> torch.Tensor:
    """[heads, L, L] weights by key position -> [heads, L, 2L-1] by offset."""
    heads, length, _ = x.shape
    x = F.pad(x, [0, length - 1, 0, 0, 0, 0]).view(heads, length * (2 * length - 1))
    x = F.pad(x, [length, 0, 0, 0]).view(heads, length, 2 * length)
    return x[:, :, 1:]


class FeedForward(nn.Module):
    def __init__(self, config: VitsConfig):
        super().__init__()
        self.conv_1 = nn.Conv1d(config.hidden_size, config.ffn_dim, config.ffn_kernel_size)
        self.conv_2 = nn.Conv1d(config.ffn_dim, config.hidden_size, config.ffn_kernel_size)
        k = config.ffn_kernel_size
        self.padding = [(k - 1) // 2, k // 2, 0, 0, 0, 0] if k > 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.permute(0, 2, 1)
        if self.padding is not None:
            x = F.pad(x, self.padding)
        x = torch.relu(self.conv_1(x))
        if self.padding is not None:
            x = F.pad(x, self.padding)
        return self.conv_2(x).permute(0, 2, 1)


class EncoderLayer(nn.Module):
    def __init__(self, config: VitsConfig):
        super().__init__()
        self.attention = RelativeAttention(config)
        self.layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.feed_forward = FeedForward(config)
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer_norm(x + self.attention(x))
        return self.final_layer_norm(x + self.feed_forward(x))


class Encoder(nn.Module):
    def __init__(self, config: VitsConfig):
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.num_hidden_layers))


class TextEncoder(nn.Module):
    def __init__(self, config: VitsConfig):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.flow_size = config.flow_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.encoder = Encoder(config)
        self.project = nn.Conv1d(config.hidden_size, config.flow_size * 2, kernel_size=1)

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``input_ids`` [1, L] -> hidden [1, L, H], prior means and log-variances [1, L, flow_size] each."""
        x = self.embed_tokens(input_ids) * math.sqrt(self.hidden_size)
        for layer in self.encoder.layers:
            x = layer(x)
        stats = self.project(x.transpose(1, 2)).transpose(1, 2)
        means, log_variances = torch.split(stats, self.flow_size, dim=2)
        return x, means, log_variances
