"""Batched prefill of the GPT trunk: the whole prompts of several sequences in one call.

The prompts are packed one after another (varlen, no padding between them): the projections and the
MLP run on all their tokens together, attention prompt by prompt with the call ``GPT.forward`` makes
for that prompt alone (the same shapes, strides and causal flag, keys read back from the cache), and
every token's key and value goes into its own slot and position. So a prompt's result depends on the
others only through the matmuls' row count: not at all with oneDNN-packed weights or fixed-scale int8,
nor with plain fp32 matmuls on a multiple of ``pad_rows_to=4`` rows (zero rows appended, as
``GPT.decode`` does); int8-dynamic takes one activation scale per call, so there it does. One prompt
alone with ``pad_rows_to=1`` runs every op ``forward`` runs: bit-exact with it (and with the reference).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .gpt import GPT, Attention, KVCache, rope_cos_sin, rotate_half


def prefill_prompts(
    gpt: GPT,
    embeds: torch.Tensor,  # [N, hidden]
    cache: KVCache,
    slots: list[int],
    lengths: list[int],
    pad_rows_to: int = 1,
) -> torch.Tensor:
    """``embeds`` holds prompt b's ``lengths[b]`` tokens after prompt b-1's; prompt b goes to positions
    ``0 .. lengths[b]-1`` of cache slot ``slots[b]`` (nothing past them is written). Returns final-norm
    hidden states ``[N, hidden]``."""
    if len(slots) != len(lengths) or not lengths or min(lengths) < 1:
        raise ValueError(f"prefill needs one length >= 1 per slot; got slots {slots}, lengths {lengths}")
    if sum(lengths) != embeds.shape[0]:
        raise ValueError(f"prompt lengths sum to {sum(lengths)} but embeds has {embeds.shape[0]} rows")
    if max(lengths) > cache.max_len:
        raise ValueError(f"prompt of {max(lengths)} positions exceeds cache {cache.max_len}")
    n_tok = embeds.shape[0]
    rows = -(-n_tok // pad_rows_to) * pad_rows_to
    h = embeds if rows == n_tok else torch.cat([embeds, embeds.new_zeros(rows - n_tok, embeds.shape[1])])
    # From host lists, moved once: no device value is read back.
    pos = torch.tensor([i for n in lengths for i in range(n)] + [0] * (rows - n_tok))
    slot_of = torch.tensor([slot for slot, n in zip(slots, lengths, strict=True) for _ in range(n)])
    pos, slot_of = pos.to(h.device, non_blocking=True), slot_of.to(h.device, non_blocking=True)
    cos, sin = rope_cos_sin(pos, gpt.inv_freq, h.dtype)
    cos, sin = cos[:, None], sin[:, None]  # [rows, 1, head_dim]: shaped once for every layer
    where = (slot_of, pos[:n_tok])
    h = gpt.run_layers(h, lambda attn, x: _attend(attn, x, cos, sin, cache, slots, lengths, where))
    return gpt.norm(h[:n_tok])


def _attend(
    attn: Attention,
    x: torch.Tensor,  # [M, hidden]: the packed prompts; rows >= sum(lengths) are padding
    cos: torch.Tensor,  # [M, 1, head_dim]
    sin: torch.Tensor,
    cache: KVCache,
    slots: list[int],
    lengths: list[int],
    where: tuple[torch.Tensor, torch.Tensor],  # [N] slot and cache position of every real token
) -> torch.Tensor:
    """``Attention.forward`` (start 0, causal) for every prompt of ``x``."""
    heads, kv_heads, head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
    m, n_tok = x.shape[0], where[0].shape[0]
    q, k, v = attn.project(x)
    q = q.reshape(m, heads, head_dim)
    k = k.reshape(m, kv_heads, head_dim)
    v = v.reshape(m, kv_heads, head_dim)
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    k_cache, v_cache = cache.k[attn.layer_idx], cache.v[attn.layer_idx]
    # Every real token's key and value in one indexed write (padding rows write nothing).
    k_cache[where[0], :, where[1]] = k[:n_tok].to(k_cache.dtype)
    v_cache[where[0], :, where[1]] = v[:n_tok].to(v_cache.dtype)
    rep = heads // kv_heads
    outs, start = [], 0
    for slot, n in zip(slots, lengths, strict=True):
        qs = q[start : start + n].unsqueeze(0).transpose(1, 2)  # [1, heads, n, head_dim], strided as forward's
        # Read back from the cache, as forward does (a bf16 cache rounds the keys the prompt sees).
        keys = k_cache[slot : slot + 1, :, :n].to(q.dtype)
        values = v_cache[slot : slot + 1, :, :n].to(q.dtype)
        if rep > 1:
            keys, values = keys.repeat_interleave(rep, dim=1), values.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(qs, keys, values, dropout_p=0.0, is_causal=n > 1, scale=head_dim**-0.5)
        outs.append(out.transpose(1, 2).reshape(n, heads * head_dim))
        start += n
    if m > n_tok:  # padding rows (pad_rows_to): zeros
        outs.append(x.new_zeros(m - n_tok, heads * head_dim))
    return attn.o_proj(torch.cat(outs) if len(outs) > 1 else outs[0])
