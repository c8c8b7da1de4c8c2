"""audio/graphs.py: Decoder + Vocos captured per (window bucket, rows bucket) at start-up and replayed for
the windows of those buckets, the same audio as the eager decode; other buckets decode eagerly; a graph
whose replay differs from the eager decode at its start-up check is refused. On the CPU a stand-in
capture keeps the graph contract: the captured call's output is a static buffer that each replay
rewrites from the static inputs (what a CUDA graph does)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from chattts_serve.audio import graphs as graphs_mod
from chattts_serve.audio.decode import decode_on_device, window_bucket
from chattts_serve.audio.graphs import AudioGraphs, stream_buckets
from chattts_serve.audio.policy import StreamPolicy
from chattts_serve.engine.config import EngineConfig
from chattts_serve.engine.plan import resolve_plan

from .test_decode import _windows

CPU = torch.device("cpu")


class _Replay:
    def __init__(self, fn, out, works: bool) -> None:
        self.fn, self.out, self.works = fn, out, works

    def replay(self) -> None:
        if self.works:
            self.out.copy_(self.fn())


def stand_in_capture(monkeypatch, works: bool = True) -> list:
    captured = []

    def capture(fn, side, pool):
        out = fn()
        captured.append(out.shape)
        return _Replay(fn, out, works), out

    monkeypatch.setattr(graphs_mod, "capture_graph", capture)
    return captured


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    from chattts_serve.models.chattts import checkpoint

    return checkpoint.load(tiny_ckpt)


def _audio(batches, n: int) -> list[np.ndarray]:
    out: list = [None] * n
    for b in batches:
        for row, (i, samples) in enumerate(zip(b.index, b.samples, strict=True)):
            out[i] = b.wav[row, :samples].numpy()
    return out


def test_graph_replays_give_the_eager_decodes_audio(model, monkeypatch):
    captured = stand_in_capture(monkeypatch)
    graphs = AudioGraphs(model, None, "fp32", lengths=[16, 24], rows=(1, 4))
    graphs.capture_all(CPU)
    assert len(captured) == 4 and set(graphs.graphs) == {(16, 1), (16, 4), (24, 1), (24, 4)} and not graphs.refused
    lengths = [9, 16, 11, 13, 14, 10, 20, 24, 17, 30]  # 6 windows of bucket 16 (pieces of 4 + 2), 3 of 24, 1 of 32
    windows = _windows(model, lengths)
    with torch.inference_mode():
        got = _audio(decode_on_device(model, windows, "fp32", buckets=True, graphs=graphs), len(windows))
        want = _audio(decode_on_device(model, windows, "fp32", buckets=True), len(windows))
    assert graphs.replays == 2 + 1  # bucket 16: 4 rows then 2 (in the 4-row graph); bucket 24: 3 rows
    assert len(captured) == 4  # nothing captured while decoding
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


def test_a_graph_that_differs_from_the_eager_decode_is_refused(model, monkeypatch):
    stand_in_capture(monkeypatch, works=False)  # replays do nothing: the start-up check sees stale audio
    graphs = AudioGraphs(model, None, "fp32", lengths=[16], rows=(2,))
    graphs.capture_all(CPU)
    assert not graphs.graphs and set(graphs.refused) == {(16, 2)}
    windows = _windows(model, [12, 15])
    with torch.inference_mode():
        got = _audio(decode_on_device(model, windows, "fp32", buckets=True, graphs=graphs), 2)
        want = _audio(decode_on_device(model, windows, "fp32", buckets=True), 2)
    assert graphs.replays == 0  # decoded eagerly
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_streams_buckets_and_where_graphs_apply():
    p = StreamPolicy()
    buckets = stream_buckets(p)
    assert buckets[0] == 8 and buckets[-1] == window_bucket(p.left_context + p.max_chunk + p.lookahead) == 128
    assert len(buckets) == 16
    assert resolve_plan(EngineConfig(), "cuda").audio_graphs and not resolve_plan(EngineConfig(), "cpu").audio_graphs
    assert not resolve_plan(EngineConfig(audio_graphs="off"), "cuda").audio_graphs
    assert not resolve_plan(EngineConfig(audio_overlap="off"), "cuda").audio_graphs  # captured on the audio stream
    assert not resolve_plan(EngineConfig(audio_buckets="off"), "cuda").audio_graphs  # shapes must repeat
    assert not resolve_plan(EngineConfig(audio_graphs="on"), "cpu").audio_graphs  # CUDA graphs only


def test_streams_served_through_the_graphs_sound_as_without(tiny_ckpt, monkeypatch):
    """The engine's streamed windows (overlapped, bucketed: CUDA's audio path) through graphs captured
    before serving: the same audio as without, and no capture while serving."""
    from chattts_serve import Engine, SamplingParams

    captured = stand_in_capture(monkeypatch)
    config = EngineConfig.with_slots(3, audio_overlap="on", audio_buckets="on")
    engine = Engine.from_pretrained(tiny_ckpt, device="cpu", config=config)
    stage = engine.core.stage
    graphs = AudioGraphs(stage.model, stage.decoder.stream, stage.audio_dtype, stream_buckets(StreamPolicy()), (1, 4))
    graphs.capture_all(CPU)
    before = len(captured)
    texts = ["今天天气不错。", "你好。", "我们一起去吃饭吧。"]
    params = [SamplingParams(seed=i, refine_text=False, min_new_tokens=50, max_new_tokens=50) for i in range(3)]
    out = {}
    for use in (None, graphs):
        stage.decoder.graphs = use
        core = engine.core
        for i, (t, p) in enumerate(zip(texts, params, strict=True)):
            core.add_request(f"r{i}", core.prepare(t, p), StreamPolicy())
        audio: dict[str, list] = {}
        while core.has_unfinished():
            for o in core.step():
                audio.setdefault(o.request_id, []).append(o.audio)
        out[use is not None] = {k: np.concatenate(v) for k, v in audio.items()}
    assert graphs.replays > 3 and len(captured) == before
    for rid, a in out[False].items():
        np.testing.assert_allclose(out[True][rid], a, rtol=0, atol=1e-5)
