"""A bf16 or int8 KV cache under the torch trunk (``RunnerConfig.kv_cache_dtype``, models/chattts/gpt.py's casts
and ``KVCache.write``): close to the fp32 cache, half its bytes (int8 with its scales: 0.27), batch-invariant, and
refused where it does not apply."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from chattts_serve import Engine, SamplingParams
from chattts_serve.engine.config import EngineConfig, RunnerConfig, from_flat
from chattts_serve.models.chattts import checkpoint
from chattts_serve.models.chattts.gpt import KVCache

PARAMS = SamplingParams(seed=5, max_new_tokens=24, refine_text=False)
TEXTS = ["你好，世界。", "Hello there, my friend.", "Good morning."]


def _bf16(slots: int, precision: str = "fp32", decode: str = "auto", kv: str = "bf16") -> EngineConfig:
    runner = RunnerConfig(decode=decode, kv_cache_dtype=kv)
    return EngineConfig.with_slots(slots, precision=precision, runner=runner)


@pytest.mark.parametrize("kv_dtype,bound", [(torch.bfloat16, 2e-2), (torch.int8, 5e-2)])
@pytest.mark.parametrize("step", ["decode", "decode_static"])
def test_bf16_cache_stays_close_to_fp32(tiny_ckpt, step, kv_dtype, bound):
    model = checkpoint.load(tiny_ckpt)
    gpt, hidden = model.gpt, model.config.gpt.hidden_size
    gen = torch.Generator().manual_seed(0)
    caches = {dt: gpt.new_cache(2, 40, dtype=dt) for dt in (torch.float32, kv_dtype)}
    assert caches[kv_dtype].k.dtype == kv_dtype and caches[kv_dtype].quantized == (kv_dtype == torch.int8)
    for cache in caches.values():  # the static step reads masked positions too (as the runner, zero them)
        cache.zero_()
    prompts = [torch.randn(1, n, hidden, generator=gen) for n in (7, 12)]
    steps = [torch.randn(2, hidden, generator=gen) for _ in range(5)]
    out = {}
    with torch.inference_mode():
        for dt, cache in caches.items():
            for slot, emb in enumerate(prompts):
                n = emb.shape[1]
                gpt(emb, torch.arange(n)[None], cache, torch.tensor([slot]), 0, None)
            lengths, hs = [7, 12], []
            for emb in steps:
                if step == "decode":
                    hs.append(gpt.decode(emb, cache, [0, 1], lengths))
                else:  # the static (CUDA-graph) step, eager on the CPU
                    hs.append(gpt.decode_static(emb, cache, torch.tensor(lengths), 20))
                lengths = [n + 1 for n in lengths]
            out[dt] = torch.stack(hs)
    ref, test = out[torch.float32], out[kv_dtype]
    assert test.dtype == torch.float32 and torch.isfinite(test).all()
    rel = float((test - ref).norm() / ref.norm())
    # bf16 keeps 8 bits of mantissa: ~0.4 % per element; int8 half a step of 1/127 of each vector's largest
    assert 1e-6 < rel < bound


@pytest.mark.parametrize("kv", ["bf16", "int8"])
def test_engine_with_bf16_cache_is_repeatable_and_batch_invariant(tiny_ckpt, kv):
    engine = Engine.from_pretrained(tiny_ckpt, config=_bf16(4, kv=kv))
    assert engine.core.stage.runner.cache.k.dtype == {"bf16": torch.bfloat16, "int8": torch.int8}[kv]
    batched = engine.synthesize(TEXTS, PARAMS)
    again = engine.synthesize(TEXTS, PARAMS)
    alone = engine.synthesize(TEXTS[1:2], PARAMS)[0]
    for a, b in zip(batched, again, strict=True):
        assert a.codes.shape[0] > 0 and np.isfinite(a.audio).all()
        np.testing.assert_array_equal(a.codes, b.codes)
    np.testing.assert_array_equal(batched[1].codes, alone.codes)


@pytest.mark.parametrize("kv", ["bf16", "int8"])
def test_bf16_cache_with_int8_static_and_the_static_step(tiny_ckpt, kv):
    for config in (_bf16(2, "int8-static", kv=kv), _bf16(2, decode="static", kv=kv)):
        [r] = Engine.from_pretrained(tiny_ckpt, config=config).synthesize(TEXTS[:1], PARAMS)
        assert r.codes.shape[0] > 0 and np.isfinite(r.audio).all()


def test_bf16_cache_halves_the_bytes_per_slot(tiny_ckpt):
    model = checkpoint.load(tiny_ckpt)
    g = model.config.gpt
    assert KVCache.bytes_per_slot(g, 256, torch.bfloat16) * 2 == KVCache.bytes_per_slot(g, 256, torch.float32)


def test_int8_cache_counts_its_scales(tiny_ckpt):
    """int8 keys and values and one fp32 scale per vector: (head_dim + 4) / (4 head_dim) of fp32's bytes."""
    g = checkpoint.load(tiny_ckpt).config.gpt
    fp32, int8 = (KVCache.bytes_per_slot(g, 256, dt) for dt in (torch.float32, torch.int8))
    assert int8 * 4 * g.head_dim == fp32 * (g.head_dim + 4)
    cache = KVCache(g.num_layers, 3, g.num_kv_heads, 256, g.head_dim, torch.int8, "cpu")
    held = sum(t.numel() * t.element_size() for t in (cache.k, cache.v, cache.k_scale, cache.v_scale))
    assert held == 3 * int8


def test_bad_values_and_ort_are_refused(tiny_ckpt, tmp_path):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        RunnerConfig(kv_cache_dtype="int4")
    assert from_flat(kv_cache_dtype="bf16").runner.kv_cache_dtype == "bf16"
    pytest.importorskip("onnxruntime")
    config = EngineConfig.with_slots(
        1, precision="ort-fp32", runner=RunnerConfig(kv_cache_dtype="bf16", onnx_cache_dir=str(tmp_path))
    )
    with pytest.raises(ValueError, match="ort-\\* cache is fp32"):
        Engine.from_pretrained(tiny_ckpt, config=config)
    config = replace(config, runner=replace(config.runner, kv_cache_dtype="int8"))
    with pytest.raises(ValueError, match="kv_cache_dtype int8 is for the torch precisions"):
        Engine.from_pretrained(tiny_ckpt, config=config)
