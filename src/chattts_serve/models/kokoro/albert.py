"""PL-BERT: the phoneme-level ALBERT that reads the whole utterance before the prosody predictor.

Our own ALBERT (no transformers import): one shared transformer layer applied ``num_hidden_layers``
times, tanh-GELU, post-norm. Names follow the official state dict (``embeddings.word_embeddings``,
``encoder.albert_layer_groups.0.albert_layers.0...``, ``pooler``); the pooler is in the file but its
output is never used, so it is loaded and not run.

Batching: padded keys are masked out of attention. Alone, an utterance runs attention without a mask,
as the package does (transformers drops an all-ones mask), so batch 1 takes the package's exact path.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from .config import PlbertConfig


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """ALBERT's ``gelu_new``, written as the reference writes it (the fused kernel rounds differently)."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class AlbertEmbeddings(nn.Module):
    def __init__(self, config: PlbertConfig, n_token: int):
        super().__init__()
        self.word_embeddings = nn.Embedding(n_token, config.embedding_size, padding_idx=0)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.embedding_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.embedding_size)
        self.LayerNorm = nn.LayerNorm(config.embedding_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        positions = torch.arange(t, device=input_ids.device)[None, :]
        # Every token has type 0; the reference adds the type embedding first, then the position one.
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(torch.zeros_like(input_ids))
        x = x + self.position_embeddings(positions)
        return self.LayerNorm(x)


class AlbertAttention(nn.Module):
    def __init__(self, config: PlbertConfig):
        super().__init__()
        h = config.hidden_size
        self.heads = config.num_attention_heads
        self.head_size = config.head_size
        self.query = nn.Linear(h, h)
        self.key = nn.Linear(h, h)
        self.value = nn.Linear(h, h)
        self.dense = nn.Linear(h, h)
        self.LayerNorm = nn.LayerNorm(h, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (proj(x).view(b, t, self.heads, self.head_size).transpose(1, 2)
                   for proj in (self.query, self.key, self.value))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, scale=self.head_size**-0.5)
        out = out.transpose(1, 2).reshape(b, t, -1)
        return self.LayerNorm(x + self.dense(out))


class AlbertLayer(nn.Module):
    def __init__(self, config: PlbertConfig):
        super().__init__()
        self.full_layer_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attention = AlbertAttention(config)
        self.ffn = nn.Linear(config.hidden_size, config.intermediate_size)
        self.ffn_output = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        x = self.attention(x, key_mask)
        return self.full_layer_layer_norm(self.ffn_output(gelu_tanh(self.ffn(x))) + x)


class _LayerGroup(nn.Module):
    def __init__(self, config: PlbertConfig):
        super().__init__()
        self.albert_layers = nn.ModuleList([AlbertLayer(config)])


class AlbertEncoder(nn.Module):
    def __init__(self, config: PlbertConfig):
        super().__init__()
        self.layers = config.num_hidden_layers
        self.embedding_hidden_mapping_in = nn.Linear(config.embedding_size, config.hidden_size)
        self.albert_layer_groups = nn.ModuleList([_LayerGroup(config)])


class Albert(nn.Module):
    """ALBERT's last hidden state for right-padded ids [B, T] (``lengths`` None: no row is padded)."""

    def __init__(self, config: PlbertConfig, n_token: int):
        super().__init__()
        self.embeddings = AlbertEmbeddings(config, n_token)
        self.encoder = AlbertEncoder(config)
        self.pooler = nn.Linear(config.hidden_size, config.hidden_size)  # in the file; its output is unused

    def forward(self, input_ids: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """``valid``: bool [B, T], True on real tokens; None when no row is padded."""
        key_mask = None if valid is None else valid[:, None, None, :]
        x = self.encoder.embedding_hidden_mapping_in(self.embeddings(input_ids))
        layer = self.encoder.albert_layer_groups[0].albert_layers[0]
        for _ in range(self.encoder.layers):  # ALBERT shares one layer across depth
            x = layer(x, key_mask)
        return x
