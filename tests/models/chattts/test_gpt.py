"""models/chattts/gpt.py: RMSNorm, RoPE and the GPT trunk with its static KV cache."""

from __future__ import annotations

import math

import pytest
import torch

from chattts_serve.models.chattts.config import GPTConfig
from chattts_serve.models.chattts.gpt import GPT, RMSNorm, apply_rope, rope_cos_sin, rope_inv_freq

ATOL = 1e-5


def small_cfg(**kw) -> GPTConfig:
    base = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=4, intermediate_size=48)
    base.update(kw)
    return GPTConfig(**base)


def make_gpt(cfg: GPTConfig, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    gpt = GPT(cfg)
    with torch.no_grad():  # non-trivial norm gains too
        for name, p in gpt.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    return gpt.eval()


def run_full(gpt: GPT, emb: torch.Tensor) -> torch.Tensor:
    """The whole sequence in one forward pass: [B, T, hidden]."""
    b, t, _ = emb.shape
    cache = gpt.new_cache(b, t)
    pos = torch.arange(t)[None].expand(b, t)
    return gpt(emb, pos, cache, torch.arange(b), 0, None, last_only=False)


# ---------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize("eps", [1e-6, 1e-2])
def test_rmsnorm_formula(eps):
    torch.manual_seed(0)
    norm = RMSNorm(16, eps)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16))
    x = torch.randn(3, 5, 16) * 4
    expected = torch.empty_like(x)
    for i in range(3):
        for j in range(5):
            v = x[i, j].double()
            rms = math.sqrt(float((v**2).mean()) + eps)
            expected[i, j] = (norm.weight.double() * v / rms).float()
    torch.testing.assert_close(norm(x), expected, rtol=1e-5, atol=1e-6)


def _reference_rmsnorm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """The reference's (Hugging Face LlamaRMSNorm) formula: fp32 math, cast back, then the weight."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.eps)
    return norm.weight * h.to(x.dtype)


def test_rmsnorm_is_the_reference_formula_to_the_bit_in_fp32():
    g = torch.Generator().manual_seed(1)
    norm = RMSNorm(768, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(768, generator=g))
    x = torch.randn(7, 768, generator=g) * 3
    assert torch.equal(norm(x), _reference_rmsnorm(norm, x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rmsnorm_in_half_precision_is_at_least_as_close_to_fp32_as_the_reference(dtype):
    """F.rms_norm in bf16/fp16 rounds once (the reference's formula twice): not its bits, but no
    further from the fp32 math on the same half-precision inputs and weight (mean error)."""
    g = torch.Generator().manual_seed(2)
    norm = RMSNorm(768, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(768, generator=g))
    norm = norm.to(dtype)
    x = (torch.randn(64, 768, generator=g) * 3).to(dtype)
    h = x.float()
    exact = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.float()
    got, ref = norm(x), _reference_rmsnorm(norm, x)
    assert got.dtype == ref.dtype == dtype
    assert (got.float() - exact).abs().mean() <= (ref.float() - exact).abs().mean()
    assert torch.equal(norm(x[:5]), got[:5])  # per row: the batch does not change a row


# ---------------------------------------------------------------- RoPE


def rope_reference(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x [B, H, T, D], positions [B, T]; dims j and j + D/2 rotate by pos * theta^(-2j/D)."""
    b, h, t, d = x.shape
    out = torch.empty_like(x, dtype=torch.float64)
    xd = x.double()
    for bi in range(b):
        for ti in range(t):
            pos = float(positions[bi, ti])
            for j in range(d // 2):
                ang = pos * theta ** (-2.0 * j / d)
                c, s = math.cos(ang), math.sin(ang)
                a, bb = xd[bi, :, ti, j], xd[bi, :, ti, j + d // 2]
                out[bi, :, ti, j] = a * c - bb * s
                out[bi, :, ti, j + d // 2] = a * s + bb * c
    return out


@pytest.mark.parametrize("head_dim,theta", [(8, 10000.0), (16, 500.0)])
def test_rope_matches_pairwise_rotation(head_dim, theta):
    torch.manual_seed(1)
    x = torch.randn(2, 3, 5, head_dim)
    positions = torch.tensor([[0, 1, 2, 3, 4], [1, 1, 7, 30, 100]])
    inv_freq = rope_inv_freq(head_dim, theta)
    cos, sin = rope_cos_sin(positions, inv_freq, torch.float32)
    assert cos.shape == sin.shape == (2, 5, head_dim)
    out = apply_rope(x, cos, sin)
    torch.testing.assert_close(out.double(), rope_reference(x, positions, theta), rtol=1e-4, atol=1e-4)


def test_rope_position_zero_is_identity_and_norm_preserving():
    torch.manual_seed(2)
    x = torch.randn(1, 2, 4, 8)
    cos, sin = rope_cos_sin(torch.tensor([[0, 3, 9, 50]]), rope_inv_freq(8, 10000.0), torch.float32)
    out = apply_rope(x, cos, sin)
    torch.testing.assert_close(out[:, :, 0], x[:, :, 0])
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1))


# ---------------------------------------------------------------- KV cache: prefill + decode


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_prefill_then_decode_equals_full_sequence(kv_heads):
    cfg = small_cfg(num_kv_heads=kv_heads)
    gpt = make_gpt(cfg)
    torch.manual_seed(3)
    total, prompt = 12, 5
    emb = torch.randn(2, total, cfg.hidden_size)
    with torch.no_grad():
        full = run_full(gpt, emb)
        cache = gpt.new_cache(2, total)
        slots = torch.arange(2)
        pos = torch.arange(prompt)[None].expand(2, prompt)
        h = gpt(emb[:, :prompt], pos, cache, slots, 0)
        torch.testing.assert_close(h, full[:, prompt - 1], rtol=0, atol=ATOL)
        for t in range(prompt, total):
            h = gpt(emb[:, t : t + 1], torch.full((2, 1), t), cache, slots, t)
            assert h.shape == (2, cfg.hidden_size)
            torch.testing.assert_close(h, full[:, t], rtol=0, atol=ATOL)


def test_cache_written_in_place_and_never_grows():
    cfg = small_cfg()
    gpt = make_gpt(cfg)
    cache = gpt.new_cache(1, 10)
    k_ptr, v_ptr = cache.k.data_ptr(), cache.v.data_ptr()
    shape = tuple(cache.k.shape)
    assert shape == (cfg.num_layers, 1, cfg.num_kv_heads, 10, cfg.head_dim)
    cache.k.fill_(0.0), cache.v.fill_(0.0)  # the cache starts uninitialised (torch.empty); mark it
    torch.manual_seed(4)
    with torch.no_grad():
        gpt(torch.randn(1, 4, cfg.hidden_size), torch.arange(4)[None], cache, torch.arange(1), 0)
        assert cache.k[:, :, :, :4].abs().sum() > 0
        assert not cache.k[:, :, :, 4:].any() and not cache.v[:, :, :, 4:].any()
        for t in range(4, 10):
            gpt(torch.randn(1, 1, cfg.hidden_size), torch.tensor([[t]]), cache, torch.arange(1), t)
            assert cache.k.data_ptr() == k_ptr and cache.v.data_ptr() == v_ptr
            assert tuple(cache.k.shape) == tuple(cache.v.shape) == shape
    assert (cache.k.abs().sum(dim=(0, 1, 2, 4)) > 0).all()  # every position written


def test_positions_beyond_cache_raise():
    cfg = small_cfg()
    gpt = make_gpt(cfg)
    cache = gpt.new_cache(1, 4)
    with torch.no_grad():
        with pytest.raises(ValueError, match="exceeds cache"):
            gpt(torch.randn(1, 5, cfg.hidden_size), torch.arange(5)[None], cache, torch.arange(1), 0)
        gpt(torch.randn(1, 4, cfg.hidden_size), torch.arange(4)[None], cache, torch.arange(1), 0)
        with pytest.raises(ValueError, match="exceeds cache"):
            gpt(torch.randn(1, 1, cfg.hidden_size), torch.tensor([[4]]), cache, torch.arange(1), 4)


# ---------------------------------------------------------------- batched, left-padded


def padded_prefill_mask(valid: torch.Tensor) -> torch.Tensor:
    """[B, T] -> [B, 1, T, T]: query i sees valid keys j <= i; padding queries see themselves."""
    b, t = valid.shape
    mask = torch.zeros(b, 1, t, t, dtype=torch.bool)
    for bi in range(b):
        for i in range(t):
            for j in range(i + 1):
                mask[bi, 0, i, j] = bool(valid[bi, j])
            mask[bi, 0, i, i] = True
    return mask


@pytest.mark.parametrize("kv_heads", [4, 1])
def test_left_padded_batch_equals_rows_alone(kv_heads):
    cfg = small_cfg(num_kv_heads=kv_heads)
    gpt = make_gpt(cfg, seed=5)
    torch.manual_seed(6)
    lens = [3, 7, 5]
    steps = 4
    plen = max(lens)
    prompts = [torch.randn(n, cfg.hidden_size) for n in lens]
    step_embs = torch.randn(len(lens), steps, cfg.hidden_size)

    with torch.no_grad():
        # each row alone, no padding, plain causal attention
        alone = []
        for b, p in enumerate(prompts):
            cache = gpt.new_cache(1, len(p) + steps)
            hs = [gpt(p[None], torch.arange(len(p))[None], cache, torch.arange(1), 0)]
            for s in range(steps):
                pos = torch.tensor([[len(p) + s]])
                hs.append(gpt(step_embs[b : b + 1, s : s + 1], pos, cache, torch.arange(1), len(p) + s))
            alone.append(torch.cat(hs))  # [steps + 1, hidden]

        # the batch, left-padded to plen (padding rows hold garbage embeddings)
        emb = torch.randn(len(lens), plen, cfg.hidden_size) * 10
        valid = torch.zeros(len(lens), plen + steps, dtype=torch.bool)
        valid[:, plen:] = True
        positions = torch.ones(len(lens), plen, dtype=torch.long)
        for b, (p, n) in enumerate(zip(prompts, lens, strict=True)):
            emb[b, plen - n :] = p
            valid[b, plen - n : plen] = True
            positions[b, plen - n :] = torch.arange(n)
        cache = gpt.new_cache(len(lens), plen + steps)
        slots = torch.arange(len(lens))
        hs = [gpt(emb, positions, cache, slots, 0, padded_prefill_mask(valid[:, :plen]))]
        for s in range(steps):
            pos = torch.tensor(lens)[:, None] + s
            start = plen + s
            mask = valid[:, None, None, : start + 1]
            hs.append(gpt(step_embs[:, s : s + 1], pos, cache, slots, start, mask))
        batched = torch.stack(hs, dim=1)  # [B, steps + 1, hidden]

    for b in range(len(lens)):
        torch.testing.assert_close(batched[b], alone[b], rtol=0, atol=ATOL)


def test_non_contiguous_slots_match_contiguous():
    """Rows placed in arbitrary slots of a larger cache (the gather path) give the same result."""
    cfg = small_cfg()
    gpt = make_gpt(cfg, seed=7)
    torch.manual_seed(8)
    emb = torch.randn(2, 6, cfg.hidden_size)
    with torch.no_grad():
        ref = run_full(gpt, emb)
        cache = gpt.new_cache(4, 6)
        cache.k.fill_(0.0)  # uninitialised (torch.empty) until written; mark it
        slots = torch.tensor([3, 1])
        h = gpt(emb[:, :4], torch.arange(4)[None].expand(2, 4), cache, slots, 0)
        torch.testing.assert_close(h, ref[:, 3], rtol=0, atol=ATOL)
        for t in (4, 5):
            h = gpt(emb[:, t : t + 1], torch.full((2, 1), t), cache, slots, t)
            torch.testing.assert_close(h, ref[:, t], rtol=0, atol=ATOL)
        assert not cache.k[:, [0, 2]].any()  # untouched slots stay empty


def test_multi_token_chunk_after_prefill_equals_full_sequence():
    """A chunk of several tokens at start > 0 sees all earlier keys and is causal within itself."""
    gpt = make_gpt(small_cfg())
    torch.manual_seed(1)
    emb = torch.randn(1, 8, 32)
    full = run_full(gpt, emb)
    cache = gpt.new_cache(1, 8)
    pos = torch.arange(8)[None]
    gpt(emb[:, :4], pos[:, :4], cache, torch.arange(1), 0, None, last_only=False)
    chunk = gpt(emb[:, 4:], pos[:, 4:], cache, torch.arange(1), 4, None, last_only=False)
    torch.testing.assert_close(chunk, full[:, 4:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
def test_a_cpu_cache_is_not_mapped_for_huge_pages(monkeypatch, dtype):
    """A slot's keys and values are faulted in 4 KB at a time as its positions fill: on 2 MB pages its first
    prompt paid ~3.5 ms a page in the kernel and made every page its heads span resident at once."""
    from chattts_serve import malloc

    def refused(*args, **kwargs):
        raise AssertionError("the KV cache maps nothing of its own")

    monkeypatch.setattr(malloc, "huge_pages", refused)
    monkeypatch.setattr(malloc.mmap, "mmap", refused)
    cache = make_gpt(small_cfg()).new_cache(2, 64, dtype=dtype)
    assert cache.k.is_contiguous() and cache.k.dtype == dtype
