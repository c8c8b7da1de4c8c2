"""Input embeddings (text + 4 audio codebooks) and output heads (text + 4 audio codebooks).

Names follow ``asset/Embed.safetensors``. The heads are weight-normed in the checkpoint
(``parametrizations.weight.original0`` = g, ``original1`` = v); ``fold_weight_norm`` turns them into
plain matrices once at load with the same op the reference uses (``torch._weight_norm``), so the
logits are bit-identical without paying for the norm every step.

The code heads read 7.7 MB of fp32 weights a step: at one row, next to the int4 trunk's 97 MB, about a
tenth of the step (oneDNN, cold: ~0.4 ms of ~4.5). ``pack_heads(code_dtype=torch.bfloat16)`` (the int4
mode) runs them as one bf16 matrix instead: half the bytes, one call (``eval`` int4: top-1 0.8631 ->
0.8613, KL 0.00431 -> 0.00432; 4-bit heads cost 0.789 and 0.0109, so they stay in bf16).
"""

from __future__ import annotations

import torch
from torch import nn

from ...kernels.linear import linear, pack_weight, packed_linear
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
        self._packed_code_bf16: torch.Tensor | None = None
        """``pack_heads(code_dtype=bfloat16)``: the code heads as one [num_vq * vocab, hidden] bf16 weight."""

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

    def pack_heads(self, code_dtype: torch.dtype = torch.float32) -> None:
        """Use oneDNN-packed head weights from now on (see ``kernels.linear``); ``code_dtype`` bf16: the code
        heads as one bf16 matrix (module docstring; needs ``packing_available(device, torch.bfloat16)``)."""
        if code_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"code heads are packed in fp32 or bf16, not {code_dtype}")
        self._packed_text = pack_weight(self.head_text)
        if code_dtype == torch.bfloat16:
            self._packed_code_bf16 = pack_weight(self.head_code.detach().flatten(0, 1).bfloat16())
            self._packed_code = None
        else:
            self._packed_code = [pack_weight(self.head_code[q]) for q in range(self.num_vq)]
            self._packed_code_bf16 = None

    @property
    def heads_packed(self) -> bool:
        """The heads run oneDNN-packed: a row's logits are the same bits whatever the other rows."""
        return self._packed_code is not None or self._packed_code_bf16 is not None

    @property
    def code_heads_dtype(self) -> torch.dtype:
        """The code heads' weight dtype as they run (bf16 in the int4 mode, fp32 otherwise)."""
        return torch.bfloat16 if self._packed_code_bf16 is not None else torch.float32

    def text_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, hidden] -> [B, num_text_tokens] in fp32."""
        return linear(hidden.float(), self.head_text, self._packed_text)

    def code_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, hidden] -> [B * num_vq, num_audio_tokens] in fp32, row b * num_vq + q."""
        h = hidden.float()
        if self._packed_code_bf16 is not None:  # [B, num_vq * vocab]: column q * vocab + v, so row b * num_vq + q
            logits = packed_linear(h.bfloat16(), self._packed_code_bf16).float()
            return logits.reshape(-1, self.head_code.shape[1])
        packed = self._packed_code or [None] * self.num_vq
        logits = [linear(h, self.head_code[q], packed[q]) for q in range(self.num_vq)]
        return torch.stack(logits, dim=1).flatten(0, 1)
