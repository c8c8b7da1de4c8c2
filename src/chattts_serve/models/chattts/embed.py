"""Input embeddings (text + 4 audio codebooks) and output heads (text + 4 audio codebooks).

Names follow ``asset/Embed.safetensors``. The heads are weight-normed in the checkpoint
(``parametrizations.weight.original0`` = g, ``original1`` = v); ``fold_weight_norm`` turns them into
plain matrices once at load with the same op the reference uses (``torch._weight_norm``), so the
logits are bit-identical without paying for the norm every step.
"""

from __future__ import annotations

import torch
from torch import nn

from ...kernels.linear import linear, pack_weight
from .config import GPTConfig


def fold_weight_norm(g: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """W = g * v / ||v|| with the norm per output row (weight_norm dim 0)."""
    return torch._weight_norm(v, g, 0)


class Embed(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.num_vq = cfg.num_vq
        self.emb_code = nn.ModuleList(nn.Embedding(cfg.num_audio_tokens, cfg.hidden_size) for _ in range(cfg.num_vq))
        self.emb_text = nn.Embedding(cfg.num_text_tokens, cfg.hidden_size)
        # Folded head weights (see module docstring); [vocab, hidden].
        self.head_text = nn.Parameter(torch.empty(cfg.num_text_tokens, cfg.hidden_size))
        self.head_code = nn.Parameter(torch.empty(cfg.num_vq, cfg.num_audio_tokens, cfg.hidden_size))
        self._packed_text: torch.Tensor | None = None
        self._packed_code: list[torch.Tensor] | None = None

    def embed_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [..., num_vq] -> [..., hidden]: sum over codebooks in q order (stack then sum, as the
        reference does, so the fp32 result is bit-identical)."""
        return torch.stack([self.emb_code[q](codes[..., q]) for q in range(self.num_vq)], dim=-1).sum(-1)

    def embed_text(self, ids: torch.Tensor) -> torch.Tensor:
        return self.emb_text(ids)

    def embed_prompt(self, ids: torch.Tensor, text_mask: torch.Tensor) -> torch.Tensor:
        """ids [B, T, num_vq] (text positions repeat the id), text_mask [B, T] -> [B, T, hidden].

        Text positions use ``emb_text``; every other position (audio codes, left padding) uses the
        codebook sum. Both are looked up everywhere and one picked per position (the same values as
        writing the text rows through the mask, without reading the mask back to the host).
        """
        codes = self.embed_codes(ids.masked_fill(text_mask[..., None], 0))
        text = self.emb_text(ids[..., 0].masked_fill(~text_mask, 0))
        return torch.where(text_mask[..., None], text, codes)

    def pack_heads(self) -> None:
        """Use oneDNN-packed head weights from now on (see ``kernels.linear``)."""
        self._packed_text = pack_weight(self.head_text)
        self._packed_code = [pack_weight(self.head_code[q]) for q in range(self.num_vq)]

    @property
    def heads_packed(self) -> bool:
        """The heads run oneDNN-packed: a row's logits are the same bits whatever the other rows."""
        return self._packed_code is not None

    def text_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, hidden] -> [B, num_text_tokens] in fp32."""
        return linear(hidden.float(), self.head_text, self._packed_text)

    def code_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, hidden] -> [B * num_vq, num_audio_tokens] in fp32, row b * num_vq + q."""
        h = hidden.float()
        packed = self._packed_code or [None] * self.num_vq
        logits = [linear(h, self.head_code[q], packed[q]) for q in range(self.num_vq)]
        return torch.stack(logits, dim=1).flatten(0, 1)
