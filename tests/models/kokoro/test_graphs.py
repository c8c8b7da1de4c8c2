"""models/kokoro/graphs.py: the text side per (rows, tokens) bucket, F0 and energy and the decoder per (rows,
frames) bucket. On the CPU the graphs are stood in for (``tests.support.graph_capture``: each replay reruns the
captured call into its static output), so what runs is the exact bucket-padded forward a CUDA graph captures: each
row of a mixed batch gets its unpadded batch-1 result (durations exact; the waveform within the decoder's bound, or
the phase drift's with the text side graphed too), a batch past the largest bucket or with a refused graph runs
eagerly, the captured forwards take no host value, and the served model counts its replays."""

from __future__ import annotations

import pytest
import torch

from chattts_serve import models
from chattts_serve.engine import bucket_graphs
from chattts_serve.engine.config import EngineConfig, from_flat
from chattts_serve.models.kokoro.graphs import AUDIO_BOUND, F0_ATOL, F0_RTOL, TEXT_AUDIO_BOUND, KokoroGraphs
from chattts_serve.models.kokoro.model import Utterance
from chattts_serve.models.kokoro.voices import load_voice, style_for
from chattts_serve.sampling_params import SamplingParams
from tests.support.graph_capture import StandInCapture
from tests.support.host_syncs import host_syncs

LENGTHS = (5, 13, 19, 9, 3)  # phonemes: 10 to 42 frames on the tiny checkpoint
FRAMES = (16, 64)
TOKENS = (16, 64)


def _rows(root) -> list[Utterance]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for i, n in enumerate(LENGTHS):
        ids = [0, *torch.randint(1, 178, (n,), generator=gen).tolist(), 0]
        voice = ("af_heart", "zf_xiaobei")[i % 2]
        out.append(Utterance(ids, style_for(load_voice(root, voice), n), (1.0, 1.2)[i % 2],
                             torch.Generator().manual_seed(100 + i)))
    return out


def _fresh(rows: list[Utterance]) -> list[Utterance]:
    """The same utterances with their generators reseeded (a draw moves a generator)."""
    return [Utterance(u.input_ids, u.style, u.speed, torch.Generator().manual_seed(100 + i))
            for i, u in enumerate(rows)]


@pytest.fixture(scope="module")
def model(kokoro_tiny):
    from chattts_serve.models.kokoro.checkpoint import load

    return load(kokoro_tiny)


@pytest.fixture
def graphed(model):
    """The decoder's graphs alone (the text side row by row, as without graphs)."""
    capture = StandInCapture()
    model.graphs = KokoroGraphs(model, max_rows=4, frames=FRAMES, capture=capture, text=False).capture_all()
    yield model.graphs, capture
    model.graphs = None


def test_each_row_of_a_bucket_padded_batch_is_its_batch1_result(model, kokoro_tiny, graphed):
    graphs, capture = graphed
    rows = _rows(kokoro_tiny)
    captured = len(capture.shapes)
    assert captured == 9 and graphs.describe()["refused"] == 0  # rows 1, 2, 4 x frames 16, 32, 64
    together = model.synthesize(_fresh(rows))
    assert graphs.counters() == {"graph_replays": 2, "eager_steps": 0, "graphs_refused": 0}  # 4 rows, then 1
    assert len(capture.shapes) == captured  # nothing captured while serving
    model.graphs = None
    for row, u in zip(together, _fresh(rows), strict=True):
        alone = model.synthesize([u])[0]
        assert torch.equal(row.durations, alone.durations) and torch.equal(row.f0, alone.f0)
        assert row.audio.shape == alone.audio.shape
        assert (row.audio - alone.audio).abs().max().item() <= AUDIO_BOUND


def test_with_the_text_side_graphed_too_durations_stay_exact(model, kokoro_tiny):
    """The text side as one padded forward (``prosody="batch"``): durations exact, F0 and energy within rounding,
    the waveform within the sine phase's drift; a batch past the largest frame bucket still gets its F0 from the
    same padded forward, run eagerly."""
    capture = StandInCapture()
    model.graphs = KokoroGraphs(model, max_rows=4, frames=FRAMES, tokens=TOKENS, capture=capture).capture_all()
    try:
        graphs = model.graphs
        tables = graphs.describe()["tables"]
        assert {k: v["captured"] for k, v in tables.items()} == {
            "kokoro text": 9, "kokoro curves": 9, "kokoro decoder": 9}  # rows 1, 2, 4 x 3 buckets each
        together = model.synthesize(_fresh(_rows(kokoro_tiny)))
        assert graphs.counters() == {"graph_replays": 6, "eager_steps": 0, "graphs_refused": 0}  # 4 + 1 rows each
        style = _rows(kokoro_tiny)[0].style
        long = model.synthesize([Utterance([0, *([50] * 40), 0], style, 1.0, torch.Generator().manual_seed(7))])
        assert graphs.curves.eager == 1 and graphs.decoder.eager == 1 and graphs.text.eager == 0
    finally:
        model.graphs = None
    for row, u in zip(together, _fresh(_rows(kokoro_tiny)), strict=True):
        alone = model.synthesize([u])[0]
        assert torch.equal(row.durations, alone.durations)
        torch.testing.assert_close(row.f0, alone.f0, rtol=F0_RTOL, atol=F0_ATOL)
        torch.testing.assert_close(row.energy, alone.energy, rtol=F0_RTOL, atol=F0_ATOL)
        assert row.audio.shape == alone.audio.shape
        assert (row.audio - alone.audio).abs().max().item() <= TEXT_AUDIO_BOUND
    alone = model.synthesize([Utterance([0, *([50] * 40), 0], style, 1.0, torch.Generator().manual_seed(7))])[0]
    assert torch.equal(long[0].durations, alone.durations) and long[0].audio.shape == alone.audio.shape


def test_a_batch_past_the_largest_bucket_runs_the_eager_decoder(model, kokoro_tiny, graphed):
    graphs, _ = graphed
    style = _rows(kokoro_tiny)[0].style
    ids = [0, *([50] * 40), 0]  # ~80 frames: past the 64-frame bucket

    def batch():
        return [Utterance(ids, style, 1.0, torch.Generator().manual_seed(7)), *_fresh(_rows(kokoro_tiny))[:2]]

    got = model.synthesize(batch())
    assert graphs.counters()["eager_steps"] == 1 and graphs.counters()["graph_replays"] == 0
    model.graphs = None
    want = model.synthesize(batch())
    for a, b in zip(got, want, strict=True):  # the eager decoder exactly: no draw happened before the choice
        assert torch.equal(a.audio, b.audio)


def test_a_refused_graph_leaves_its_bucket_to_the_eager_decoder(model, kokoro_tiny):
    model.graphs = KokoroGraphs(model, max_rows=2, frames=(64, 64), capture=StandInCapture(works=False), text=False)
    try:
        model.graphs.capture_all()
        assert model.graphs.counters() == {"graph_replays": 0, "eager_steps": 0, "graphs_refused": 2}
        got = model.synthesize(_fresh(_rows(kokoro_tiny))[:2])
        assert model.graphs.counters()["eager_steps"] == 1
    finally:
        model.graphs = None
    want = model.synthesize(_fresh(_rows(kokoro_tiny))[:2])
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a.audio, b.audio)


@pytest.mark.parametrize("table", ["text", "curves", "decoder"])
def test_the_captured_forwards_take_no_host_value(model, table):
    graphs = KokoroGraphs(model, max_rows=2, frames=(32, 32), tokens=(32, 32), capture=StandInCapture())
    part = getattr(graphs, table)
    static = part.inputs(2, 32)
    part.probe(static, 32, torch.Generator().manual_seed(0))
    with torch.inference_mode():
        out, counts = host_syncs(lambda: part.forward(static))
    assert not counts and torch.isfinite(out).all()


def test_served_kokoro_captures_at_load_with_cuda_graphs_and_counts_replays(kokoro_tiny, monkeypatch):
    """``--cuda-graphs`` (the default) captures at load where the model is on CUDA; ``--no-cuda-graphs`` does not.
    No GPU here: CUDA is stood in for (``wanted`` and the capture)."""
    from chattts_serve.engine.engine import Engine
    from chattts_serve.models.kokoro import graphs as graphs_mod

    monkeypatch.setattr(bucket_graphs, "wanted", lambda device, config: config.runner.cuda_graphs)
    real = graphs_mod.KokoroGraphs.__init__
    monkeypatch.setattr(graphs_mod.KokoroGraphs, "__init__",
                        lambda self, model, max_rows, strict=False: real(self, model, max_rows, strict, FRAMES,
                                                                         capture=StandInCapture(), tokens=TOKENS))
    family = models.get("kokoro")
    off = family.load(kokoro_tiny, torch.device("cpu"), from_flat(max_num_seqs=2, cuda_graphs=False))
    assert off.model.graphs is None and off.counters() == {}
    engine = Engine.from_pretrained(kokoro_tiny, "cpu", EngineConfig.with_slots(2), family="kokoro")
    assert engine.core.stage.model.model.graphs is not None
    engine.synthesize(["你好，世界。"], SamplingParams(speaker="zf_xiaobei", seed=1))
    stats = engine.core.stats()
    assert stats.graph_replays >= 1 and stats.graphs_refused == 0
