"""The engine's graphs have one owner (``cuda_graph.GraphStore``): one capture stream for every capture,
never the audio stream (even when torch's stream pool wraps round), and no reference cycle, so an
engine dropped takes its graphs with it at once. Stand-in CUDA calls (``tests/cuda_stub.py``)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from chattts_serve.audio.overlap import AudioDecoder
from chattts_serve.engine.config import EngineConfig, RunnerConfig
from chattts_serve.engine.cuda_graph import GraphStore
from chattts_serve.engine.engine import Engine
from chattts_serve.engine.scheduler import SchedulerConfig
from chattts_serve.sampling_params import SamplingParams
from tests.support.cuda_stub import FakeCuda, FakeStream

CUDA1 = torch.device("cuda", 1)


@pytest.fixture
def pooled_streams(monkeypatch):
    """Stand-in CUDA whose ``Stream()`` hands out torch's pool: 32 streams per device, round robin
    (the 33rd equals the first)."""
    calls = FakeCuda.install(monkeypatch)
    drawn: dict[torch.device, int] = {}

    class PoolStream(FakeStream):
        def __eq__(self, other):
            return isinstance(other, PoolStream) and (self.device, self.slot) == (other.device, other.slot)

        def __hash__(self):
            return hash((self.device, self.slot))

    def stream(device=None, priority=0):
        s = PoolStream(device, priority, calls=calls)
        s.slot = drawn.get(s.device, 0) % 32
        drawn[s.device] = drawn.get(s.device, 0) + 1
        calls.add("Stream", s.device)
        return s

    monkeypatch.setattr(torch.cuda, "Stream", stream)
    return calls


def engine_with_step_graphs(tiny_ckpt) -> Engine:
    config = EngineConfig(
        scheduler=SchedulerConfig(max_num_seqs=24, max_model_len=256),
        runner=RunnerConfig(decode="static", sampling_noise="counter", step_graphs="on"),
    )
    return Engine.from_pretrained(tiny_ckpt, device="cpu", config=config)


def test_step_graphs_are_captured_at_start_up_on_one_stream_and_never_during_a_step(tiny_ckpt, monkeypatch):
    engine = engine_with_step_graphs(tiny_ckpt)
    calls = FakeCuda.install(monkeypatch)
    runner, sg = engine.runner, engine.runner.decode_path
    sg.use_graphs = True  # the stand-in graphs record nothing: each is refused, its bucket eager
    sg.capture_all()  # what start-up does on CUDA
    streams = [s for _, s, kw in calls.captures]
    assert len(streams) == len(sg.buckets()) == 12  # batch 1, 2, 4, 8, 16, 24 x ctx 256 x text rows or not
    assert all(s is runner.graph_store.stream for s in streams)
    assert all(kw.get("capture_error_mode") == "thread_local" for _, _, kw in calls.captures)
    assert len(runner.graph_store.retired) == len(streams)  # refused graphs are kept, not destroyed
    calls.log.clear()
    params = SamplingParams(seed=3, max_new_tokens=12, refine_text=False)
    engine.synthesize(["Hello there."], params)  # a small batch bucket, then a larger one
    engine.synthesize(["Hello there, my friend.", "Good morning to you all.", "你好，世界。"] * 3, params)
    assert len(calls.captures) == 12 and not calls.named("graph") and not calls.named("synchronize")
    assert sg.eager_steps > 0


def test_the_capture_stream_is_never_the_audio_stream(tiny_ckpt, pooled_streams):
    from chattts_serve.models.chattts.checkpoint import load

    audio = AudioDecoder(load(tiny_ckpt), CUDA1, "fp32", overlap=True, buckets=False)
    others = [torch.cuda.Stream(device=CUDA1) for _ in range(31)]  # someone else's: the pool wraps next
    store = GraphStore(CUDA1)
    for _ in range(40):
        store.capture(lambda: torch.zeros(1))
    captured = [s for _, s, _ in pooled_streams.captures]
    assert all(s is store.stream for s in captured)
    assert store.stream != audio.stream and audio.stream.device == store.stream.device == CUDA1
    assert len(others) == 31


def test_a_dropped_engine_frees_its_graphs_without_a_gc_cycle(tiny_ckpt, monkeypatch):
    engine = engine_with_step_graphs(tiny_ckpt)
    calls = FakeCuda.install(monkeypatch)
    engine.runner.decode_path.use_graphs = True
    engine.runner.decode_path.capture_all()
    engine.synthesize(["Hello there, my friend."], SamplingParams(seed=3, max_new_tokens=8, refine_text=False))
    assert calls.graphs
    gc.collect()
    gc.disable()
    try:
        runner = engine.core.stage.runner
        refs = [weakref.ref(o) for o in (runner, runner.graph_store, runner.decode_path, *calls.graphs)]
        del engine, runner
        calls.graphs.clear(), calls.captures.clear()
        alive = [r() for r in refs if r() is not None]
        assert not alive, f"kept alive by a reference cycle: {[type(o).__name__ for o in alive]}"
    finally:
        gc.enable()


def test_close_frees_every_graph():
    store = GraphStore(torch.device("cpu"))
    store.table("trunk")[(1, 256)] = ("graph", "out")
    store.retire("refused graph")
    store.close()
    assert store.tables["trunk"] == {} and store.retired == []
