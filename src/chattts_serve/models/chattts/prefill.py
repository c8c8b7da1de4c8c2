"""Batched prefill of the GPT trunk: the prompts (or prompt chunks) of several sequences in one call.

The prompts are packed one after another (varlen, no padding between them): the projections and the
MLP run on all their tokens together, attention prompt by prompt with the call ``GPT.forward`` makes
for that prompt alone (the same shapes, strides and causal flag, keys read back from the cache), and
every token's key and value goes into its own slot and position. So a prompt's result depends on the
others only through the matmuls' row count: not at all with oneDNN-packed weights or fixed-scale int8,
nor with plain fp32 matmuls on a multiple of ``pad_rows_to=4`` rows (zero rows appended, as
``GPT.decode`` does); int8-dynamic takes one activation scale per call, so there it does. One prompt
alone with ``pad_rows_to=1`` runs every op ``forward`` runs: bit-exact with it (and with the reference).

Chunked prefill: a chunk of a prompt (``starts[b] > 0``: its first positions are cached by earlier calls)
writes its own keys after them and attends over all of them, a query at position p to the keys ``0..p``.
One SDPA call over a chunk would not give the one-shot call's bits (the CPU kernel blocks its sums by the
call's shape), so with ``block`` the attention runs in query blocks of ``block`` positions counted from 0,
one call each (the same shapes, keys and mask whichever call the block is part of): a prompt cut into
chunks at multiples of ``block`` makes exactly the attention calls its one-shot prefill makes, and with the
matmul rows independent (above) its hidden states and keys are bit-identical. ``block`` 0 keeps one call
per prompt: the reference's.

``int4`` on its C++ decode step (``GPT.fused_rows``, over a bf16 or int8 cache) prefills through that step:
the packed tokens are its rows, each at its own slot and position. The step writes every row's key and value
before any row attends, and a row attends over its slot's keys up to its own position: causal attention, one
query at a time, with the decode kernel's arithmetic. So a token's hidden state and key are the ones a decode
step feeding the prompt one token at a time would give, to the bit, however the prompts are packed or chunked
(``block`` plays no part). Against the torch ops (``_attend``: SDPA per prompt) it is the same math summed in
another order; it runs the ~15 elementwise ops a layer in C++ and the matmuls in row blocks (32 prompts of ~95
tokens, Zen 5, 2 threads: 1.30 s -> 1.05 s). Asked for a few rows (``out_rows``: the runner wants each prompt's last),
it runs the last layer's attention, o projection and MLP on those alone, after writing every token's key and value:
~4 % of a prompt's MACs less.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...device import pinned_copy
from .gpt import GPT, Attention, KVCache, rope_cos_sin, rotate_half


def prefill_prompts(
    gpt: GPT,
    embeds: torch.Tensor,  # [N, hidden]
    cache: KVCache,
    slots: list[int],
    lengths: list[int],
    pad_rows_to: int = 1,
    starts: list[int] | None = None,
    block: int = 0,
    out_rows: list[int] | None = None,
) -> torch.Tensor:
    """``embeds`` holds prompt b's ``lengths[b]`` tokens after prompt b-1's; prompt b goes to positions
    ``starts[b] .. starts[b]+lengths[b]-1`` of cache slot ``slots[b]`` (``starts`` None: all 0; nothing past
    them is written; positions before them hold the prompt's earlier chunks). ``block``: attention in query
    blocks of this many positions (``query_blocks``; 0: one call per prompt, the reference's). Returns final-norm
    hidden states ``[N, hidden]``, or with ``out_rows`` those rows' ``[len(out_rows), hidden]`` (every key and value is
    written either way; the C++ step then runs its last layer past attention's cache writes on them alone)."""
    starts = [0] * len(lengths) if starts is None else starts
    if len(slots) != len(lengths) or len(starts) != len(lengths) or not lengths or min(lengths) < 1:
        raise ValueError(f"prefill needs one length >= 1 per slot; got slots {slots}, lengths {lengths}")
    if min(starts) < 0:
        raise ValueError(f"prefill starts must be >= 0; got {starts}")
    if len(set(slots)) != len(slots):  # two prompts in one slot would write each other's positions
        raise ValueError(f"each prompt of a prefill call needs its own slot; got {slots}")
    if sum(lengths) != embeds.shape[0]:
        raise ValueError(f"prompt lengths sum to {sum(lengths)} but embeds has {embeds.shape[0]} rows")
    ends = [s + n for s, n in zip(starts, lengths, strict=True)]
    if max(ends) > cache.max_len:
        raise ValueError(f"prompt of {max(ends)} positions exceeds cache {cache.max_len}")
    n_tok = embeds.shape[0]
    rows = -(-n_tok // pad_rows_to) * pad_rows_to
    h = embeds if rows == n_tok else torch.cat([embeds, embeds.new_zeros(rows - n_tok, embeds.shape[1])])
    # From host lists, moved once: no device value is read back.
    positions = [i for first, n in zip(starts, lengths, strict=True) for i in range(first, first + n)]
    pos = torch.tensor(positions + [0] * (rows - n_tok))
    slot_of = torch.tensor([slot for slot, n in zip(slots, lengths, strict=True) for _ in range(n)])
    # Through pinned memory: ``non_blocking`` from pageable memory still waits for the copy.
    pos, slot_of = pinned_copy(pos, h.device), pinned_copy(slot_of, h.device)
    cos, sin = rope_cos_sin(pos, gpt.inv_freq, h.dtype)
    where = (slot_of, pos[:n_tok])
    # int4 on the C++ step (``GPT.fused_rows``): every token is a decode row at its own position, all keys
    # written before any row attends, so each attends causally over its prompt's keys up to itself.
    keep = None if out_rows is None else pinned_copy(torch.tensor(out_rows, dtype=torch.long), h.device)
    fused = gpt.fused_rows(h, cos, sin, cache, where, keep)
    if fused is not None:
        return fused if keep is not None else fused[:n_tok]
    cos, sin = cos[:, None], sin[:, None]  # [rows, 1, head_dim]: shaped once for every layer
    h = gpt.run_layers(h, lambda attn, x: _attend(attn, x, cos, sin, cache, slots, lengths, starts, block, where))
    out = gpt.norm(h[:n_tok])  # every row, then the ones asked for: the bits of the call without ``out_rows``
    return out if keep is None else out.index_select(0, keep)


def _attend(
    attn: Attention,
    x: torch.Tensor,  # [M, hidden]: the packed prompts; rows >= sum(lengths) are padding
    cos: torch.Tensor,  # [M, 1, head_dim]
    sin: torch.Tensor,
    cache: KVCache,
    slots: list[int],
    lengths: list[int],
    starts: list[int],
    block: int,
    where: tuple[torch.Tensor, torch.Tensor],  # [N] slot and cache position of every real token
) -> torch.Tensor:
    """``Attention.forward`` (start 0, causal) for every prompt of ``x``; a later chunk over its earlier keys."""
    heads, kv_heads, head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
    m, n_tok = x.shape[0], where[0].shape[0]
    q, k, v = attn.project(x)
    q = q.reshape(m, heads, head_dim)
    k = k.reshape(m, kv_heads, head_dim)
    v = v.reshape(m, kv_heads, head_dim)
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    # Every real token's key and value in one indexed write (padding rows write nothing); an int8 cache
    # quantizes each vector on its own, so a chunk writes the bytes the one-shot prefill writes.
    cache.write(attn.layer_idx, (where[0], slice(None), where[1]), k[:n_tok], v[:n_tok])
    rep = heads // kv_heads
    outs, start = [], 0
    for slot, n, first in zip(slots, lengths, starts, strict=True):
        qs = q[start : start + n].unsqueeze(0).transpose(1, 2)  # [1, heads, n, head_dim], strided as forward's
        pieces = []
        for lo, hi in query_blocks(first, n, block):
            # Read back from the cache, as forward does (a bf16 cache rounds the keys the prompt sees; int8
            # dequantizes them).
            keys, values = cache.read(attn.layer_idx, (slice(slot, slot + 1), slice(None), slice(None, hi)), q.dtype)
            if rep > 1:
                keys, values = keys.repeat_interleave(rep, dim=1), values.repeat_interleave(rep, dim=1)
            pieces.append(_sdpa(qs[:, :, lo - first : hi - first], keys, values, lo, head_dim**-0.5))
        out = torch.cat(pieces, dim=2) if len(pieces) > 1 else pieces[0]
        outs.append(out.transpose(1, 2).reshape(n, heads * head_dim))
        start += n
    if m > n_tok:  # padding rows (pad_rows_to): zeros
        outs.append(x.new_zeros(m - n_tok, heads * head_dim))
    return attn.o_proj(torch.cat(outs) if len(outs) > 1 else outs[0])


def query_blocks(first: int, n: int, block: int) -> list[tuple[int, int]]:
    """The attention calls of a chunk at positions ``first .. first+n-1``: ``(lo, hi)``, the queries ``lo .. hi-1``
    over the keys ``0 .. hi-1``. ``block`` 0: one call; else one per ``block`` positions counted from 0, so a prompt
    prefilled in chunks that start at multiples of ``block`` makes exactly the calls its one-shot prefill makes."""
    if not block:
        return [(first, first + n)]
    if first % block:
        raise ValueError(f"a chunk must start at a multiple of the attention block {block}; got {first}")
    return [(lo, min(lo + block, first + n)) for lo in range(first, first + n, block)]


def _sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, first: int, scale: float) -> torch.Tensor:
    """Causal attention of ``q`` (positions ``first ..``) over ``keys`` (positions ``0 ..``)."""
    n = q.shape[2]
    if first == 0 or n == 1:  # SDPA's is_causal aligns the mask with the first key: right only from 0
        return F.scaled_dot_product_attention(q, keys, values, dropout_p=0.0, is_causal=n > 1, scale=scale)
    mask = torch.arange(first + n, device=q.device)[None, :] <= torch.arange(first, first + n, device=q.device)[:, None]
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, dropout_p=0.0, scale=scale)
