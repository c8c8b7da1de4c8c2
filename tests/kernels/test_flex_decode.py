"""kernels/flex_decode.py: the static step's attention reading each row's own keys (FlexAttention over a
block mask from the rows' positions) against the float64 reference of ``kernels.decode_attention``, its
blocks (a row reads its length rounded up to a block, not the bucket), the choice of kernel, and the
whole static step with it against the masked SDPA step. On the CPU FlexAttention runs its eager
reference: the same mask and arithmetic the CUDA kernels compute."""

from __future__ import annotations

import logging

import pytest
import torch

from chattts_serve.kernels import decode_attention as da
from chattts_serve.kernels import flex_decode
from chattts_serve.models.chattts.config import GPTConfig
from chattts_serve.models.chattts.gpt import GPT


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(12, 12, 64), (8, 2, 32), (4, 4, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_row_attends_to_its_own_keys(heads, kv_heads, head_dim, dtype):
    rows, ctx = 7, 512
    g = torch.Generator().manual_seed(heads)
    k = torch.randn(rows, kv_heads, ctx, head_dim, generator=g).to(dtype)
    v = torch.randn(rows, kv_heads, ctx, head_dim, generator=g).to(dtype)
    q = torch.randn(rows, heads, head_dim, generator=g)
    last = torch.tensor([0, 126, 127, 128, 255, 300, 511])  # either side of the 128-key blocks, the whole bucket
    scale = head_dim**-0.5
    out = flex_decode.attend(q[:, :, None].to(dtype), k, v, last, scale, compiled=False)
    assert out.shape == (rows, heads, 1, head_dim)
    want = da.reference(q.to(dtype).float(), k, v, torch.arange(rows), last, scale)
    atol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16 query, probabilities and output
    torch.testing.assert_close(out[:, :, 0].float(), want, atol=atol, rtol=0)


def test_a_row_reads_its_length_rounded_up_to_a_block_not_the_bucket():
    positions = torch.tensor([0, 127, 128, 1000, 2303, 5000])  # the last: a row with nothing to decode
    mask = flex_decode.length_block_mask(positions, 2304)
    blocks = mask.kv_num_blocks.view(-1).tolist()
    assert blocks == [1, 1, 2, 8, 18, 18]
    assert sum(blocks[:5]) < 5 * 18 / 2  # the bucket would read 18 blocks a row


def test_the_static_step_with_flex_matches_the_masked_sdpa_step():
    torch.manual_seed(0)
    cfg = GPTConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
    gpt = GPT(cfg).eval()
    rows, ctx = 5, 256
    out = {}
    for attention in ("sdpa", "flex"):
        cache = gpt.new_cache(rows, ctx + 1, dtype=torch.float32)
        g = torch.Generator().manual_seed(1)
        cache.k.copy_(torch.randn(cache.k.shape, generator=g))
        cache.v.copy_(torch.randn(cache.v.shape, generator=g))
        positions = torch.tensor([3, 100, 128, 200, ctx])  # the last row: the scratch position (ignored)
        emb = torch.randn(rows, 64, generator=g)
        with torch.inference_mode():
            out[attention] = gpt.decode_static(emb, cache, positions, ctx, attention=attention)[:4]
    torch.testing.assert_close(out["flex"], out["sdpa"], atol=1e-5, rtol=0)


def test_the_choice(monkeypatch, caplog):
    for mode, device, want in (("auto", "cpu", "sdpa"), ("sdpa", "cuda", "sdpa"), ("flex", "cpu", "flex")):
        flex_decode.choose.cache_clear()
        monkeypatch.setenv(flex_decode.MODE_ENV, mode)
        assert flex_decode.choose(device, torch.float32) == want
    flex_decode.choose.cache_clear()
    monkeypatch.setenv(flex_decode.MODE_ENV, "auto")
    monkeypatch.setattr(flex_decode, "_probe", lambda device, dtype: None)
    assert flex_decode.choose("cuda", torch.bfloat16) == "flex"  # CUDA's default where the probe runs
    flex_decode.choose.cache_clear()

    def broken(device, dtype):
        raise RuntimeError("no triton")

    monkeypatch.setattr(flex_decode, "_probe", broken)
    with caplog.at_level(logging.WARNING):
        assert flex_decode.choose("cuda", torch.bfloat16) == "sdpa"  # the masked SDPA, with one warning
    assert "no triton" in caplog.text
    flex_decode.choose.cache_clear()
    monkeypatch.setenv(flex_decode.MODE_ENV, "flex")
    with pytest.raises(RuntimeError, match="no triton"):  # asked for by name: no silent fallback
        flex_decode.choose("cuda", torch.bfloat16)
    flex_decode.choose.cache_clear()
    monkeypatch.setenv(flex_decode.MODE_ENV, "fast")
    with pytest.raises(ValueError, match="auto, flex or sdpa"):
        flex_decode.choose("cpu", torch.float32)
    flex_decode.choose.cache_clear()
