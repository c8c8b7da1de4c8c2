"""The LLaMA-style GPT trunk of ChatTTS with a preallocated static KV cache.

Parameter names follow ``asset/gpt/model.safetensors`` (a Hugging Face ``LlamaModel`` state dict), so
the checkpoint loads with ``load_state_dict(assign=True)`` and no renaming. The math is written to
follow the reference op for op in fp32 (separate q/k/v projections, RMSNorm in fp32, SDPA with the
same causal/mask arguments), because the fidelity tests require identical sampled codes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels import decode_attention, flex_decode, int4_gemv, kv_int8
from ...kernels.int4_decode import Int4Decode, Int4Layer
from ...kernels.quant import Int4GemvLinear
from .config import GPTConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype:
            # One call (one fused kernel on CUDA) instead of six; x * rsqrt(mean(x^2) + eps) * w,
            # bit-identical in fp32 (the fidelity tests). In bf16/fp16 it rounds once where the
            # formula below rounds twice: closer to fp32, not the reference's bits (no bar asks them).
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [B, T] -> cos, sin [B, T, head_dim], computed in fp32 then cast."""
    freqs = positions.float()[..., None] * inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D]; cos/sin [B, T, D]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


class KVCache(nn.Module):
    """Static cache: one ``[slots, kv_heads, max_len, head_dim]`` buffer pair per layer, written in place.

    A slot holds one sequence. Nothing grows: prefill and decode write at explicit positions. An int8
    cache (``kernels.kv_int8``) also holds one fp32 scale per vector, ``[slots, kv_heads, max_len]`` per
    layer; every write goes through ``write`` (which quantizes) and every torch read through ``read``.
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        shape = (num_layers, num_slots, num_kv_heads, max_len, head_dim)
        # empty, not zeros: positions are read only after they are written, and untouched pages of a large cache
        # cost no memory on the host. Ordinary 4 KB pages, not huge ones: a 2 MB page is faulted in whole at a
        # slot's first prompt, ~3.5 ms of kernel time each on a Zen 4 VM (a 32-prompt burst's first prefill
        # +0.7-1.1 s), with no gain the engine's 32-stream rounds could resolve (BENCHMARKS.md, fourteenth session).
        self.register_buffer("k", torch.empty(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.empty(shape, dtype=dtype, device=device), persistent=False)
        # int8: one scale per vector (None otherwise).
        int8 = dtype == torch.int8
        for name in ("k_scale", "v_scale"):
            scale = torch.empty(shape[:-1], dtype=kv_int8.SCALE_DTYPE, device=device) if int8 else None
            self.register_buffer(name, scale, persistent=False)

    @staticmethod
    def bytes_per_slot(cfg: GPTConfig, max_len: int, dtype: torch.dtype) -> int:
        """Keys and values of one slot of ``max_len`` positions, all layers: the one KV-size rule (the
        runner's auto slots and a replica's memory budget both size the cache by it). int8 counts its
        scales: 64 + 4 bytes a vector at head_dim 64."""
        return 2 * cfg.num_layers * cfg.num_kv_heads * max_len * KVCache.vector_bytes(cfg.head_dim, dtype)

    @staticmethod
    def vector_bytes(head_dim: int, dtype: torch.dtype) -> int:
        """Bytes one key (or value) vector takes in a cache of ``dtype``, its scale included."""
        scale = kv_int8.SCALE_DTYPE.itemsize if dtype == torch.int8 else 0
        return head_dim * dtype.itemsize + scale

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    @property
    def num_slots(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def write(self, layer: int, index: tuple, k: torch.Tensor, v: torch.Tensor) -> None:
        """``cache[layer][index] = k, v`` (one indexed write each): cast to the cache's dtype, or quantized
        per vector for int8 (``kernels.kv_int8``: a vector's bytes depend on its own values only)."""
        if self.k_scale is None or self.v_scale is None:
            # A no-op cast unless the cache is narrower than the trunk (bf16).
            self.k[layer][index] = k.to(self.k.dtype)
            self.v[layer][index] = v.to(self.v.dtype)
            return
        (qk, sk), (qv, sv) = kv_int8.quantize(k), kv_int8.quantize(v)
        self.k[layer][index], self.k_scale[layer][index] = qk, sk
        self.v[layer][index], self.v_scale[layer][index] = qv, sv

    def read(self, layer: int, index: tuple, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``cache[layer][index]`` in ``dtype`` (a view when that is the cache's dtype; an
        int8 cache dequantized in fp32, then cast)."""
        keys, values = self.k[layer][index], self.v[layer][index]
        if self.k_scale is None or self.v_scale is None:
            return keys.to(dtype), values.to(dtype)
        ks, vs = self.k_scale[layer][index], self.v_scale[layer][index]
        return kv_int8.dequantize(keys, ks, dtype), kv_int8.dequantize(values, vs, dtype)

    def zero_(self) -> None:
        """Every position zero (finite when read), scales included."""
        for t in (self.k, self.v, self.k_scale, self.v_scale):
            if t is not None:
                t.zero_()


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.qkv_proj: nn.Module | None = None  # set by fuse_projections_
        self._qkv_sizes = (cfg.num_heads * cfg.head_dim, *(2 * [cfg.num_kv_heads * cfg.head_dim]))

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.qkv_proj is not None:
            return self.qkv_proj(x).split(self._qkv_sizes, dim=-1)
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def forward(
        self,
        x: torch.Tensor,  # [B, T, hidden]
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache,
        slots: torch.Tensor,  # [B] int64: cache slot of each row
        start: int,  # cache position of x[:, 0] (the same for every row: rows are left-aligned)
        attn_mask: torch.Tensor | None,  # [B, 1, T, start + T] bool, or None = plain causal
    ) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q, k, v = self.project(x)
        q = q.reshape(bsz, seqlen, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.reshape(bsz, seqlen, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.reshape(bsz, seqlen, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        end = start + seqlen
        # All slots in order: write and read through views, no gather copy.
        rows = slice(None) if slots.numel() == cache.num_slots else slots
        cache.write(self.layer_idx, (rows, slice(None), slice(start, end)), k, v)
        # A bf16 cache under an fp32 trunk: the prompt's attention (once per sequence) reads it upcast (int8:
        # dequantized), the keys the decode steps will read.
        keys, values = cache.read(self.layer_idx, (rows, slice(None), slice(None, end)), q.dtype)
        if self.num_kv_heads != self.num_heads:
            rep = self.num_heads // self.num_kv_heads
            keys, values = keys.repeat_interleave(rep, dim=1), values.repeat_interleave(rep, dim=1)

        if attn_mask is None and seqlen > 1 and start > 0:
            # SDPA's is_causal aligns the mask with the first key; here queries end at the last key.
            q_pos = torch.arange(start, end, device=x.device)[:, None]
            attn_mask = torch.arange(end, device=x.device)[None, :] <= q_pos
        out = F.scaled_dot_product_attention(
            q,
            keys,
            values,
            attn_mask=attn_mask,
            dropout_p=0.0,
            is_causal=attn_mask is None and seqlen > 1,
            scale=self.head_dim**-0.5,
        )
        out = out.transpose(1, 2).reshape(bsz, seqlen, self.num_heads * self.head_dim)
        return self.o_proj(out)

    def rotated_qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One token per row: x [M, hidden], cos/sin [M, 1, 1, head_dim] -> q [M, heads, 1, head_dim]
        and k, v [M, kv_heads, 1, head_dim], q and k rotated."""
        m = x.shape[0]
        if self.qkv_proj is not None:
            # Rotate q and k in one go: they are adjacent columns of the fused projection's output.
            qkv = self.qkv_proj(x)
            nq = self.num_heads + self.num_kv_heads
            qk = qkv[:, : nq * self.head_dim].reshape(m, nq, 1, self.head_dim)
            qk = qk * cos + rotate_half(qk) * sin
            v = qkv[:, nq * self.head_dim :].reshape(m, self.num_kv_heads, 1, self.head_dim)
            return qk[:, : self.num_heads], qk[:, self.num_heads :], v
        q, k, v = self.project(x)
        q = q.reshape(m, self.num_heads, 1, self.head_dim)
        k = k.reshape(m, self.num_kv_heads, 1, self.head_dim)
        v = v.reshape(m, self.num_kv_heads, 1, self.head_dim)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def decode(
        self,
        x: torch.Tensor,  # [M, hidden]; rows >= len(slots) are padding
        cos: torch.Tensor,  # [M, 1, 1, head_dim]
        sin: torch.Tensor,
        cache: KVCache,
        slots: list[int],
        lengths: list[int],  # cache positions already written per row; the new token goes there
        where: tuple[torch.Tensor, torch.Tensor],  # slots and lengths as device tensors
    ) -> torch.Tensor:
        """One new token per row, each row at its own position in its own slot.

        Attention reads exactly each row's own keys, with the same computation a batch-1 decode makes
        (torch's SDPA row by row, or ``decode_attention`` for a bf16 cache), so a row's result never
        depends on the other rows (batch invariance).
        """
        m, n = x.shape[0], len(slots)
        q, k, v = self.rotated_qkv(x, cos, sin)
        layer = self.layer_idx
        # Every row's new key/value in one indexed write (a copy: the same values as row by row).
        cache.write(layer, (where[0], slice(None), where[1]), k[:n, :, 0], v[:n, :, 0])
        k_cache, v_cache = cache.k[layer], cache.v[layer]
        scales = None if cache.k_scale is None else (cache.k_scale[layer], cache.v_scale[layer])
        if decode_attention.applies(k_cache):
            # A bf16 or int8 cache on an AVX-512 CPU: every row's keys and values read once, in one C++ call.
            scale = self.head_dim**-0.5
            qn = q[:n, :, 0]
            outs = [decode_attention.attend(qn, k_cache, v_cache, where[0], where[1], scale, scales)[:, :, None]]
        else:
            outs = self._attend_rows(q, k_cache, v_cache, slots, lengths, scales)
        if m > n:  # padding rows (pad_rows_to): zeros
            outs.append(outs[0].new_zeros(m - n, self.num_heads, 1, self.head_dim))
        out = torch.cat(outs) if len(outs) > 1 else outs[0]
        return self.o_proj(out.reshape(m, self.num_heads * self.head_dim).to(x.dtype))

    def _attend_rows(
        self, q, k_cache, v_cache, slots: list[int], lengths: list[int], scales: tuple | None = None
    ) -> list[torch.Tensor]:
        """Torch's attention, row by row over exactly each row's keys (the same call a batch-1 decode
        makes). A bf16 cache: attention runs in bf16 (the query rounded once), so the keys are read at
        half the bytes instead of upcast into a copy; the kernel accumulates in fp32. An int8 cache
        (``scales``: its layer's key and value scales): each row's keys dequantized to fp32 and attention in
        fp32, the C++ op's math (slower: the fallback where the op cannot run)."""
        q = q.float() if scales is not None else q.to(k_cache.dtype)
        rep = self.num_heads // self.num_kv_heads
        outs = []
        for row, (slot, pos) in enumerate(zip(slots, lengths, strict=True)):
            keys, values = k_cache[slot : slot + 1, :, : pos + 1], v_cache[slot : slot + 1, :, : pos + 1]
            if scales is not None:
                keys = kv_int8.dequantize(keys, scales[0][slot : slot + 1, :, : pos + 1])
                values = kv_int8.dequantize(values, scales[1][slot : slot + 1, :, : pos + 1])
            if rep > 1:
                keys, values = keys.repeat_interleave(rep, dim=1), values.repeat_interleave(rep, dim=1)
            outs.append(
                F.scaled_dot_product_attention(q[row : row + 1], keys, values, dropout_p=0.0, scale=self.head_dim**-0.5)
            )
        return outs

    def decode_static(
        self,
        x: torch.Tensor,  # [B, hidden]: row b decodes the sequence in cache slot b
        cos: torch.Tensor,  # [B, 1, 1, head_dim]
        sin: torch.Tensor,
        cache: KVCache,
        positions: torch.Tensor,  # [B] int64: where row b's new token goes
        mask: torch.Tensor,  # [B, 1, 1, ctx] bool: keys row b may attend to
        attention: str = "sdpa",
    ) -> torch.Tensor:
        """``decode`` with fixed shapes and no host values (so it can be captured in a CUDA graph).
        ``attention``: "sdpa" reads the ``ctx`` bucket under ``mask``; "flex" each row's own keys.

        Row b is slot b; every key of the first ``ctx`` cache positions is read through a view (no
        gather) and ``mask`` hides what is not the row's. A row with nothing to decode is pointed at a
        scratch position past the real ones by the caller."""
        m = x.shape[0]
        ctx = mask.shape[-1]
        q, k, v = self.rotated_qkv(x, cos, sin)
        rows = torch.arange(m, device=x.device)
        cache.write(self.layer_idx, (rows, slice(None), positions), k[:, :, 0], v[:, :, 0])
        # (see decode) bf16: attention in bf16 over the cache's views; int8: the bucket dequantized to fp32.
        dtype = torch.float32 if cache.quantized else cache.k.dtype
        keys, values = cache.read(self.layer_idx, (slice(None, m), slice(None), slice(None, ctx)), dtype)
        q = q.to(dtype)
        if attention == "flex":  # each row reads its own keys only (``kernels.flex_decode``)
            out = flex_decode.attend(q, keys, values, positions, self.head_dim**-0.5)
            return self.o_proj(out.reshape(m, self.num_heads * self.head_dim).to(x.dtype))
        if self.num_kv_heads != self.num_heads:
            rep = self.num_heads // self.num_kv_heads
            keys, values = keys.repeat_interleave(rep, dim=1), values.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, dropout_p=0.0, scale=self.head_dim**-0.5)
        return self.o_proj(out.reshape(m, self.num_heads * self.head_dim).to(x.dtype))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up_proj: nn.Module | None = None  # set by fuse_projections_
        self.row_block = 0
        """Packed prompts ([rows, hidden]) wider than this run through the MLP this many rows at a time
        (0: whole; set by ``use_int4_row_blocks_``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        rb = self.row_block
        if rb and x.dim() == 2 and x.shape[0] > rb:
            return torch.cat([self._swiglu(x[r : r + rb]) for r in range(0, x.shape[0], rb)])
        return self._swiglu(x)

    def _swiglu(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


Attend = Callable[[Attention, torch.Tensor], torch.Tensor]
"""How a trunk call attends: (the layer's ``Attention``, the normed input) -> the attention output after
``o_proj``. Each call shape brings its own (``GPT.forward``: the prompt; ``GPT.decode``: each row over its own
keys; ``GPT.decode_static``: fixed shapes; ``models.chattts.prefill``: packed prompts); the layer around it
is ``DecoderLayer.forward``, written once."""


class DecoderLayer(nn.Module):
    def __init__(self, cfg: GPTConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, attend: Attend) -> torch.Tensor:
        """The layer, the one place its math is written: pre-norm attention and SwiGLU MLP, each added to
        the residual stream (the reference's order, op for op)."""
        h = h + attend(self.self_attn, self.input_layernorm(h))
        return h + self.mlp(self.post_attention_layernorm(h))


class GPT(nn.Module):
    """Embeddings in, final-norm hidden states out. Heads and embeddings live in ``embed.Embed``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fused_decode: Int4Decode | None = None
        """``int4``: the decode step's layers in one C++ call (set by ``use_int4_decode_``)."""
        self.init_buffers()

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """(Re)build the non-persistent buffers, e.g. after loading onto a meta-device module."""
        inv_freq = rope_inv_freq(self.cfg.head_dim, self.cfg.rope_theta)
        self.register_buffer("inv_freq", inv_freq.to(device) if device else inv_freq, persistent=False)

    def run_layers(self, h: torch.Tensor, attend: Attend) -> torch.Tensor:
        """Every layer over the residual stream ``h`` (before the final norm, which the caller applies to
        the rows it keeps)."""
        for layer in self.layers:
            h = layer(h, attend)
        return h

    def new_cache(self, num_slots: int, max_len: int, dtype=None, device=None) -> KVCache:
        p = next(self.parameters())
        return KVCache(
            self.cfg.num_layers,
            num_slots,
            self.cfg.num_kv_heads,
            max_len,
            self.cfg.head_dim,
            dtype or p.dtype,
            device or p.device,
        )

    def forward(
        self,
        embeds: torch.Tensor,  # [B, T, hidden]
        positions: torch.Tensor,  # [B, T] rotary positions
        cache: KVCache,
        slots: torch.Tensor,  # [B]
        start: int,
        attn_mask: torch.Tensor | None = None,  # [B, 1, T, start + T] bool (True = attend)
        last_only: bool = True,
    ) -> torch.Tensor:
        """Returns final-norm hidden states: [B, hidden] for the last position, or [B, T, hidden]."""
        if start + embeds.shape[1] > cache.max_len:
            raise ValueError(f"sequence of {start + embeds.shape[1]} positions exceeds cache {cache.max_len}")
        cos, sin = rope_cos_sin(positions, self.inv_freq, embeds.dtype)
        h = self.run_layers(embeds, lambda attn, x: attn(x, cos, sin, cache, slots, start, attn_mask))
        if last_only:
            h = h[:, -1]
        return self.norm(h)

    def decode(
        self,
        embeds: torch.Tensor,  # [B, hidden]
        cache: KVCache,
        slots: list[int],
        lengths: list[int],
        pad_rows_to: int = 1,
    ) -> torch.Tensor:
        """One decode step for B sequences in their own slots at their own positions.

        Returns final-norm hidden states ``[rows, hidden]``, B rounded up to ``pad_rows_to`` (keep the
        padding through the heads too, then drop it).

        The position of row b is ``lengths[b]`` (its prompt starts at position 0 of its slot). With
        ``pad_rows_to=4`` the matmuls always run on a multiple of 4 rows: on our CPU BLAS that makes
        each row's result independent of how many rows run together (1-3 rows take other kernels).
        """
        bsz = embeds.shape[0]
        if max(lengths) >= cache.max_len:
            raise ValueError(f"position {max(lengths)} exceeds cache {cache.max_len}")
        rows = -(-bsz // pad_rows_to) * pad_rows_to
        h = embeds if rows == bsz else torch.cat([embeds, embeds.new_zeros(rows - bsz, embeds.shape[1])])
        pos = torch.tensor(lengths + [0] * (rows - bsz), device=h.device)
        cos, sin = rope_cos_sin(pos, self.inv_freq, h.dtype)
        where = (torch.tensor(slots, device=h.device), pos[:bsz])
        fused = self.fused_rows(h, cos, sin, cache, where)
        if fused is not None:
            return fused
        cos, sin = cos[:, None, None], sin[:, None, None]  # shaped once for every layer
        return self.norm(self.run_layers(h, lambda attn, x: attn.decode(x, cos, sin, cache, slots, lengths, where)))

    def fused_rows(
        self,
        h: torch.Tensor,  # [rows, hidden]; rows past len(where[0]) are padding
        cos: torch.Tensor,  # [rows, head_dim]
        sin: torch.Tensor,
        cache: KVCache,
        where: tuple[torch.Tensor, torch.Tensor],  # each real row's slot and position
        keep: torch.Tensor | None = None,  # [k] int64: the real rows wanted (None: all)
    ) -> torch.Tensor | None:
        """``int4``'s C++ step (``fused_decode``) over rows each at its own slot and position, keys and values
        written into ``cache``: final-norm hidden states (the step applies the norm where it holds its weight,
        with ``self.norm``'s bits), of ``keep``'s rows only where it is given (``Int4Decode.run``). None where the
        step does not run: no step, or a cache its attention cannot read (the caller runs the torch ops)."""
        fused = self.fused_decode
        if fused is None or not fused.applies(cache.k):
            return None
        scales = None if cache.k_scale is None else (cache.k_scale, cache.v_scale)
        if fused.final_norm is not None:
            return fused.run(h, cos, sin, cache.k, cache.v, scales, *where, normed=True, keep=keep)
        return self.norm(fused.run(h, cos, sin, cache.k, cache.v, scales, *where, keep=keep))

    def decode_static(
        self, embeds: torch.Tensor, cache: KVCache, positions: torch.Tensor, ctx: int, attention: str = "sdpa"
    ) -> torch.Tensor:
        """One decode step for slots ``0..B-1`` (row b = slot b) attending over the first ``ctx`` cache
        positions: fixed shapes, no host sync, graph-capturable (see ``engine.cuda_graph``). ``attention``:
        "sdpa" (the bucket, masked) or "flex" (each row's own keys: ``kernels.flex_decode``).

        ``positions[b]`` is where row b's token goes; rows with nothing to decode point at a scratch
        position >= ``ctx`` (their output is ignored). Returns final-norm hidden states ``[B, hidden]``."""
        cos, sin = rope_cos_sin(positions, self.inv_freq, embeds.dtype)
        cos, sin = cos[:, None, None], sin[:, None, None]
        mask = (torch.arange(ctx, device=embeds.device)[None, :] <= positions[:, None])[:, None, None, :]
        h = self.run_layers(embeds, lambda attn, x: attn.decode_static(x, cos, sin, cache, positions, mask, attention))
        return self.norm(h)


def _concat(*linears: nn.Linear) -> nn.Linear:
    w = torch.cat([lin.weight.detach() for lin in linears])
    fused = nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
    fused.weight = nn.Parameter(w, requires_grad=False)
    return fused


def use_int4_decode_(gpt: GPT) -> bool:
    """``int4`` (fused projections on ``kernels.int4_gemv``): run the decode step's layers as one C++ call
    (``kernels.int4_decode``) where it can; False where it cannot (the torch ops run, as before)."""
    per_layer = [
        (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        for layer in gpt.layers
    ]
    linears = [lin for four in per_layer for lin in four]
    if not all(isinstance(lin, Int4GemvLinear) and lin.bias is None for lin in linears):
        return False
    # The step reads every layer's weights in this order each step: one stream on huge pages, held once.
    for lin, packed in zip(linears, int4_gemv.one_stream([lin.packed for lin in linears]), strict=True):
        lin.packed = packed
    layers = [
        Int4Layer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight, *(lin.packed for lin in four))
        for layer, four in zip(gpt.layers, per_layer, strict=True)
    ]
    cfg = gpt.cfg
    gpt.fused_decode = Int4Decode.build(layers, cfg.num_heads, cfg.num_kv_heads, cfg.rms_norm_eps, gpt.norm.weight)
    return gpt.fused_decode is not None


INT4_MLP_ROW_BLOCK = 128
"""Rows of a packed prompt per MLP pass on the int4 GEMV. Whole, a 2048-row call's gate/up output (50 MB)
and SwiGLU's (25 MB) go out to memory and back; in blocks they stay in cache, and the GEMV's calls are
mid-width ones (its tile runs). Zen 5, 2 threads, full size, 2048 rows: 23.5-25.0 ms whole, 19.3 ms in
blocks of 128, 19.9-21.9 of 256, 24.8 of 512."""


def use_int4_row_blocks_(gpt: GPT) -> None:
    """``int4`` on the C++ GEMV (``use_int4_decode_`` built its step): run wide MLP calls in row blocks.
    The GEMV's rows are independent of each other and SwiGLU is elementwise, so no bit changes; the dense
    fallback (a BLAS matmul) is not row-independent and keeps whole calls."""
    if gpt.fused_decode is not None:
        for layer in gpt.layers:
            layer.mlp.row_block = INT4_MLP_ROW_BLOCK


def fuse_projections_(gpt: GPT) -> None:
    """q/k/v into one ``qkv_proj`` and gate/up into one ``gate_up_proj`` (in place): 4 matmuls per layer
    instead of 7, and for int8 modes one activation quantisation instead of three. Every output is the
    same dot product as before, but the BLAS may block a wider matrix differently, so the reference-exact
    path (fp32, one slot) keeps the separate projections."""
    for layer in gpt.layers:
        a, m = layer.self_attn, layer.mlp
        if a.qkv_proj is None:
            a.qkv_proj = _concat(a.q_proj, a.k_proj, a.v_proj)
            del a.q_proj, a.k_proj, a.v_proj
        if m.gate_up_proj is None:
            m.gate_up_proj = _concat(m.gate_proj, m.up_proj)
            del m.gate_proj, m.up_proj
