"""models/vits/graphs.py: the flow and decoder per (rows, frames) bucket. On the CPU the graphs are stood in for
(``tests.support.graph_capture``), so what runs is the exact bucket-padded forward a CUDA graph captures: each row
of a mixed batch gets its unpadded batch-1 result (durations exact, the noise still each request's own), a group
past the largest bucket or with a refused graph decodes eagerly, the captured forward takes no host value, and
the served model counts its replays."""

from __future__ import annotations

import pytest
import torch

from chattts_serve import models
from chattts_serve.engine import bucket_graphs
from chattts_serve.engine.config import EngineConfig, from_flat
from chattts_serve.models.vits.graphs import VitsGraphs
from chattts_serve.models.vits.model import Utterance
from chattts_serve.sampling_params import SamplingParams
from tests.support.graph_capture import StandInCapture
from tests.support.host_syncs import host_syncs

from .test_model import BATCH_BOUND

SENTENCES = ["hello world", "a", "kick", "it's four o'clock", "the quick brown fox jumps over the lazy dog"]
FRAMES = (16, 128)  # the last sentence (~180 frames on the tiny checkpoint) is past the largest bucket


def _batch(tokenizer, n: int) -> list[Utterance]:
    return [Utterance(tokenizer.encode(t), noise_scale=0.667, noise_scale_duration=0.8,
                      generator=torch.Generator().manual_seed(100 + i)) for i, t in enumerate(SENTENCES[:n])]


@pytest.fixture
def graphed(vits_model):
    capture = StandInCapture()
    saved = vits_model.batch_decoder, vits_model.max_padding
    # every row in one padded group (the accelerator's path, forced: all masks exercised on ragged rows)
    vits_model.batch_decoder, vits_model.max_padding = True, float("inf")
    vits_model.graphs = VitsGraphs(vits_model, max_rows=4, frames=FRAMES, capture=capture).capture_all()
    yield vits_model.graphs, capture
    vits_model.graphs = None
    vits_model.batch_decoder, vits_model.max_padding = saved


def test_each_row_of_a_bucket_padded_batch_is_its_batch1_result(vits_model, vits_tokenizer, graphed):
    graphs, capture = graphed
    captured = len(capture.shapes)
    assert captured == 12 and graphs.graphs.refused == 0  # rows 1, 2, 4 x frames 16, 32, 64, 128
    together = vits_model.synthesize(_batch(vits_tokenizer, 4))
    assert graphs.counters() == {"graph_replays": 1, "eager_steps": 0, "graphs_refused": 0}
    assert len(capture.shapes) == captured
    vits_model.graphs = None
    for row, utt in zip(together, _batch(vits_tokenizer, 4), strict=True):
        alone = vits_model.synthesize([utt])[0]
        assert torch.equal(row.durations, alone.durations) and row.audio.shape == alone.audio.shape
        assert (row.audio - alone.audio).abs().max().item() <= BATCH_BOUND


def test_a_group_past_the_largest_bucket_decodes_eagerly(vits_model, vits_tokenizer, graphed):
    graphs, _ = graphed
    got = vits_model.synthesize(_batch(vits_tokenizer, 5))
    assert graphs.counters()["eager_steps"] == 1 and graphs.counters()["graph_replays"] == 0
    vits_model.graphs = None
    want = vits_model.synthesize(_batch(vits_tokenizer, 5))
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a.audio, b.audio)


def test_a_refused_graph_leaves_its_bucket_to_the_eager_decoder(vits_model, vits_tokenizer):
    vits_model.graphs = VitsGraphs(vits_model, max_rows=1, frames=(64, 64), capture=StandInCapture(works=False))
    try:
        vits_model.graphs.capture_all()
        assert vits_model.graphs.counters()["graphs_refused"] == 1
        got = vits_model.synthesize(_batch(vits_tokenizer, 1))
        assert vits_model.graphs.counters()["eager_steps"] == 1
    finally:
        vits_model.graphs = None
    assert torch.equal(got[0].audio, vits_model.synthesize(_batch(vits_tokenizer, 1))[0].audio)


def test_the_captured_forward_takes_no_host_value(vits_model):
    graphs = VitsGraphs(vits_model, max_rows=2, frames=(32, 32), capture=StandInCapture())
    static = graphs._inputs(2, 32)
    graphs._probe(static, 32, torch.Generator().manual_seed(0))
    with torch.inference_mode():
        out, counts = host_syncs(lambda: graphs._forward(static))
    assert not counts and torch.isfinite(out).all()


def test_served_vits_captures_at_load_with_cuda_graphs_and_counts_replays(vits_tiny, monkeypatch):
    """``--cuda-graphs`` (the default) captures at load where the model is on CUDA; ``--no-cuda-graphs`` does not.
    No GPU here: CUDA is stood in for (``wanted``, the capture, and the padded groups an accelerator runs)."""
    from chattts_serve.engine.engine import Engine
    from chattts_serve.models.vits import graphs as graphs_mod

    monkeypatch.setattr(bucket_graphs, "wanted", lambda device, config: config.runner.cuda_graphs)
    real = graphs_mod.VitsGraphs.__init__
    monkeypatch.setattr(graphs_mod.VitsGraphs, "__init__",
                        lambda self, model, max_rows, strict=False: real(self, model, max_rows, strict, FRAMES,
                                                                         capture=StandInCapture()))
    family = models.get("vits")
    off = family.load(vits_tiny, torch.device("cpu"), from_flat(max_num_seqs=2, cuda_graphs=False))
    assert off.model.graphs is None and off.counters() == {}
    engine = Engine.from_pretrained(vits_tiny, "cpu", EngineConfig.with_slots(2), family="vits")
    model = engine.core.stage.model.model
    assert model.graphs is not None
    model.batch_decoder = True
    engine.synthesize(["hello world. kick."], SamplingParams(seed=1))
    stats = engine.core.stats()
    assert stats.graph_replays >= 1 and stats.graphs_refused == 0
