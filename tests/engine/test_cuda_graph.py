"""The static decode step (the CUDA-graph path) on CPU: same math as the per-row step, no graph. The
graph capture itself needs CUDA (skipped here; ``scripts/gpu_check.py`` covers it on a GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from chattts_serve.engine.config import EngineConfig, RunnerConfig
from chattts_serve.engine.cuda_graph import StaticDecoder, batch_buckets, ctx_buckets
from chattts_serve.engine.engine import Engine
from chattts_serve.engine.scheduler import SchedulerConfig
from chattts_serve.model.checkpoint import load
from chattts_serve.sampling_params import SamplingParams

TEXTS = ["你好，世界。", "Hello there, my friend.", "Good morning to you all."]


def test_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(16) == [1, 2, 4, 8, 16]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert ctx_buckets(2304) == [256, 512, 1024, 2048, 2304]
    assert ctx_buckets(100) == [100]


@pytest.fixture(scope="module")
def gpt(tiny_ckpt):
    return load(tiny_ckpt).gpt


def _prefill(gpt, cache, slot: int, n: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(1, n, gpt.cfg.hidden_size, generator=g)
    gpt(emb, torch.arange(n)[None], cache, torch.tensor([slot]), 0)


@torch.inference_mode()
def test_static_step_matches_rows_step_with_holes(gpt):
    max_len = 64
    rows_cache = gpt.new_cache(6, max_len)
    static_cache = gpt.new_cache(6, max_len + 1)
    static_cache.k.normal_(), static_cache.v.normal_()  # anything a write changes shows
    slots, lengths = [4, 1, 3], [9, 20, 5]  # slots 0, 2, 5 decode nothing this step
    for slot, n in zip(slots, lengths, strict=True):
        for cache in (rows_cache, static_cache):
            _prefill(gpt, cache, slot, n, seed=slot)
    before = static_cache.k.clone()
    emb = torch.randn(3, gpt.cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    want = gpt.decode(emb, rows_cache, slots, lengths)
    dec = StaticDecoder(gpt, static_cache, use_graphs=False)
    got = dec(emb, slots, lengths)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # Each decoded slot got its new key at its position; idle slots changed only at the scratch position.
    for slot, pos in zip(slots, lengths, strict=True):
        torch.testing.assert_close(static_cache.k[:, slot, :, pos], rows_cache.k[:, slot, :, pos])
    changed = (static_cache.k != before).any(dim=(0, 2, 4))  # [slot, position]
    for idle in (0, 2, 5):  # in the batch bucket (slots 0..5), written only at the scratch position
        assert changed[idle].nonzero().flatten().tolist() == [max_len]
    for slot, n in zip(slots, lengths, strict=True):  # the prompt positions before the new one: untouched
        assert not changed[slot, :n].any()


def test_static_decoder_refuses_positions_past_the_cache(gpt):
    cache = gpt.new_cache(2, 16 + 1)
    dec = StaticDecoder(gpt, cache, use_graphs=False)
    with pytest.raises(ValueError, match="exceeds cache"):
        dec(torch.zeros(1, gpt.cfg.hidden_size), [0], [16])


def test_engine_static_decode_gives_the_same_codes(tiny_ckpt, tiny_engine):
    params = SamplingParams(seed=3, max_new_tokens=40)
    want = tiny_engine.synthesize(TEXTS, params)
    static = Engine.from_pretrained(tiny_ckpt, config=EngineConfig.with_slots(4, runner=RunnerConfig(decode="static")))
    assert static.core.runner.static is not None and not static.core.runner.static.use_graphs  # no CUDA
    got = static.synthesize(TEXTS, params)
    for a, b in zip(want, got, strict=True):
        np.testing.assert_array_equal(a.codes, b.codes)
        np.testing.assert_allclose(a.audio, b.audio, atol=1e-6)


@pytest.mark.slow  # torch.compile of the step: a minute on 2 cores
@pytest.mark.timeout(600)
def test_compiled_static_step_gives_the_same_codes(tiny_ckpt):
    sched = SchedulerConfig(max_num_seqs=1, max_model_len=200)
    params = SamplingParams(seed=4, max_new_tokens=16, refine_text=False)
    eager = Engine.from_pretrained(
        tiny_ckpt, config=EngineConfig(scheduler=sched, runner=RunnerConfig(decode="static"))
    )
    compiled = Engine.from_pretrained(
        tiny_ckpt, config=EngineConfig(scheduler=sched, runner=RunnerConfig(decode="static", compile=True))
    )
    a, b = eager.synthesize(TEXTS[:1], params)[0], compiled.synthesize(TEXTS[:1], params)[0]
    np.testing.assert_array_equal(a.codes, b.codes)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_graph_replay_equals_eager_on_cuda(tiny_ckpt):
    params = SamplingParams(seed=3, max_new_tokens=40)
    eager = Engine.from_pretrained(
        tiny_ckpt, "cuda", EngineConfig.with_slots(4, runner=RunnerConfig(cuda_graphs=False))
    )
    graph = Engine.from_pretrained(tiny_ckpt, "cuda", EngineConfig.with_slots(4))
    assert graph.core.runner.static.graphs
    for a, b in zip(eager.synthesize(TEXTS, params), graph.synthesize(TEXTS, params), strict=True):
        np.testing.assert_array_equal(a.codes, b.codes)
