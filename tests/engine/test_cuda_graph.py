"""The static decode step (the CUDA-graph path) on CPU: same math as the per-row step, no graph. The
graph capture itself needs CUDA (skipped here; ``scripts/gpu_check.py`` covers it on a GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from chattts_serve.engine.config import EngineConfig, RunnerConfig
from chattts_serve.engine.cuda_graph import StaticDecoder, batch_buckets, ctx_buckets, graph_matches_eager
from chattts_serve.engine.engine import Engine
from chattts_serve.engine.scheduler import SchedulerConfig
from chattts_serve.models.chattts.checkpoint import load
from chattts_serve.sampling_params import SamplingParams
from tests.support.cuda_stub import FakeCuda

TEXTS = ["你好，世界。", "Hello there, my friend.", "Good morning to you all."]


def test_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(16) == [1, 2, 4, 8, 16]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert batch_buckets(512) == [2**i for i in range(10)]  # powers of two: every bucket captured at start-up
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
    assert static.plan.decode == "static" and not static.runner.decode_path.static.use_graphs  # no CUDA
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
    assert graph.runner.decode_path.static.graphs
    for a, b in zip(eager.synthesize(TEXTS, params), graph.synthesize(TEXTS, params), strict=True):
        np.testing.assert_array_equal(a.codes, b.codes)


# --------------------------------------------------------------------------------------------------
# The graph self-check and the device context, on the CPU: fake graphs stand in for CUDA ones.


def test_self_check_passes_a_graph_that_writes_the_eager_result():
    out = torch.zeros(3, 4)
    want = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    ok, diff = graph_matches_eager(lambda: out.copy_(want), out, lambda: want.clone())
    assert ok and diff == 0.0


@pytest.mark.parametrize("replay", ["writes nothing", "stale capture-time output"])
def test_self_check_refuses_a_graph_that_does_not_compute(replay):
    out = torch.zeros(3, 4)
    stale = torch.ones(3, 4)
    want = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    fake = (lambda: None) if replay == "writes nothing" else (lambda: out.copy_(stale))
    ok, diff = graph_matches_eager(fake, out, lambda: want.clone())
    assert not ok and diff > 0


class StubCtx:
    """A context manager that does nothing, keeping its arguments (stands in for torch.cuda's)."""

    def __init__(self, *a, **k):
        self.a, self.k = a, k

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _FakeGraph:
    """Stands in for a CUDAGraph: ``replay`` recomputes the step into the static output (a good graph)
    or does nothing (an empty graph, as a capture on the wrong device leaves)."""

    def __init__(self, dec: StaticDecoder, bs: int, ctx: int, good: bool) -> None:
        self.dec, self.bs, self.ctx, self.good = dec, bs, ctx, good
        self.out = dec._eager(bs, ctx).clone()
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        if self.good:
            self.out.copy_(self.dec._eager(self.bs, self.ctx))

    def pool(self):
        return None


def _fake_captured(gpt, monkeypatch, bad: set[tuple[int, int]], strict: bool = False) -> StaticDecoder:
    cache = gpt.new_cache(4, 32 + 1)
    cache.k.zero_(), cache.v.zero_()
    dec = StaticDecoder(gpt, cache, use_graphs=False, strict_graphs=strict)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)

    def capture(bs, ctx):
        g = _FakeGraph(dec, bs, ctx, good=(bs, ctx) not in bad)
        return g, g.out

    dec._capture = capture
    dec.capture_all()
    return dec


def test_capture_all_drops_graphs_that_fail_the_self_check_with_one_warning(gpt, monkeypatch, caplog):
    with caplog.at_level("WARNING", logger="chattts_serve.engine.cuda_graph"):
        dec = _fake_captured(gpt, monkeypatch, bad={(2, 32)})
    assert (2, 32) not in dec.graphs and (4, 32) in dec.graphs and (1, 32) in dec.graphs
    assert dec.graphs_refused == 1
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "batch 2 ctx 32" in warnings[0].getMessage()
    # Steps: a good bucket replays its graph, the refused one runs eagerly; both give the eager result.
    emb = torch.randn(2, gpt.cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    replay = dec(emb[:1], [0], [3])  # batch bucket 1
    eager = dec(emb, [0, 1], [4, 5])  # batch bucket 2: refused
    assert (dec.graph_replays, dec.eager_steps) == (1, 1)
    assert torch.isfinite(replay).all() and torch.isfinite(eager).all()


def test_capture_all_raises_on_a_mismatch_when_strict(gpt, monkeypatch):
    with pytest.raises(RuntimeError, match="differ from the eager step"):
        _fake_captured(gpt, monkeypatch, bad={(4, 32)}, strict=True)


def test_capture_and_replay_run_on_the_engines_device(gpt, monkeypatch):
    """``cuda:1``: the device context is entered with it around capture and replay, and every capture
    records on the engine's one capture stream, of that device (stand-in CUDA calls, no GPU)."""
    calls = FakeCuda.install(monkeypatch)
    cache = gpt.new_cache(4, 16 + 1)
    cache.k.zero_(), cache.v.zero_()
    dec = StaticDecoder(gpt, cache, use_graphs=False)
    dec.device = dec.store.device = cuda1 = torch.device("cuda", 1)  # tensors stay on the CPU
    dec.check_graphs = lambda: None  # checked above; the fake graphs compute nothing
    dec.capture_all()
    assert calls.log[0] == ("device", cuda1)
    streams = {id(s) for _, s, _ in calls.captures}
    assert len(calls.captures) == len(dec.graphs) > 1 and streams == {id(dec.store.stream)}
    assert calls.devices() == {cuda1}
    calls.log.clear()
    dec(torch.zeros(1, gpt.cfg.hidden_size), [0], [2])
    assert calls.log == [("device", cuda1), ("graph.replay", cuda1)] and dec.graph_replays == 1


def test_engine_stats_count_eager_static_steps(tiny_ckpt):
    eng = Engine.from_pretrained(tiny_ckpt, config=EngineConfig.with_slots(2, runner=RunnerConfig(decode="static")))
    eng.synthesize(TEXTS[:1], SamplingParams(seed=3, max_new_tokens=8, refine_text=False))
    stats = eng.core.stats()
    assert stats.eager_steps > 0 and stats.graph_replays == 0 and stats.graphs_refused == 0


# ---------------------------------------------------------------- compile once, pinned buffers, SDPA log


@pytest.mark.slow  # torch.compile
@torch.inference_mode()
def test_compiled_step_compiles_a_bounded_number_of_times_for_every_bucket(gpt):
    """Symbolic sizes: every (batch, ctx) bucket of a 48-slot cache runs on at most 3 compiled graphs
    (static shapes compiled one per bucket: 7 x 4 = 28 here, ~180 at 256 slots). Traced with a
    counting backend that runs the graph eagerly, so no C++ compiler is needed; outputs as eager."""
    import torch._dynamo

    from chattts_serve.engine.cuda_graph import compile_step

    compiles: list[int] = []

    def counting(gm, example_inputs):
        compiles.append(len(example_inputs))
        return gm.forward

    torch._dynamo.reset()
    cache = gpt.new_cache(48, 1101)
    cache.k.normal_(generator=torch.Generator().manual_seed(0)), cache.v.normal_()
    step = compile_step(gpt.decode_static, backend=counting)
    g = torch.Generator().manual_seed(1)
    sizes = [(bs, ctx) for bs in batch_buckets(48) for ctx in ctx_buckets(1100)]
    assert len(sizes) == 28
    for bs, ctx in sizes:
        emb = torch.randn(bs, gpt.cfg.hidden_size, generator=g)
        pos = torch.randint(0, ctx, (bs,), generator=g)
        want = gpt.decode_static(emb, cache, pos, ctx)
        torch.testing.assert_close(step(emb, cache, pos, ctx), want, rtol=0, atol=0)
    assert 1 <= len(compiles) <= 3, compiles
    torch._dynamo.reset()


def test_static_decoder_logs_its_attention_backend(gpt, caplog):
    import logging

    cache = gpt.new_cache(2, 300)
    with caplog.at_level(logging.INFO, logger="chattts_serve.engine.cuda_graph"):
        dec = StaticDecoder(gpt, cache, use_graphs=False)
    assert dec.attention_backend in ("FLASH_ATTENTION", "MATH", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")
    assert any("SDPA backend" in r.getMessage() for r in caplog.records)


def test_sdpa_backend_names_the_math_kernel_when_only_it_is_allowed():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from chattts_serve.engine.cuda_graph import sdpa_backend

    q, k = torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 16, 8)
    with sdpa_kernel([SDPBackend.MATH]):
        assert sdpa_backend(q, k, k, None) == "MATH"


@torch.inference_mode()
def test_a_compiled_step_without_graphs_compiles_at_start_up(gpt, monkeypatch):
    """Step graphs capture the step lazily, so the trunk's compile would land in the first request;
    the decoder runs it at construction instead, touching only the scratch position."""
    import torch._dynamo

    import chattts_serve.engine.cuda_graph as cg

    compiles: list[int] = []

    def counting(gm, example_inputs):
        compiles.append(len(example_inputs))
        return gm.forward

    real = cg.compile_step
    monkeypatch.setattr(cg, "compile_step", lambda fn: real(fn, backend=counting))
    torch._dynamo.reset()
    cache = gpt.new_cache(8, 65)
    cache.k.normal_(generator=torch.Generator().manual_seed(0)), cache.v.normal_()
    before = cache.k.clone()
    StaticDecoder(gpt, cache, use_graphs=False, compile=True)
    assert compiles, "nothing compiled at start-up"
    changed = (cache.k != before).any(dim=(0, 2, 4))  # [slot, position]
    assert changed[:, :64].sum() == 0  # only the scratch position (64) was written
    torch._dynamo.reset()
