"""audio/graph_cache.py: an OpenVINO audio graph is built once per checkpoint and runtime, read back at the next
start with the same bits, rebuilt when its entry is damaged, and never shared between checkpoints."""

from __future__ import annotations

import pytest
import torch

from chattts_serve.audio import cpu_graph, graph_cache
from chattts_serve.audio.cpu_graph import AudioGraph
from chattts_serve.models.chattts.checkpoint import load
from chattts_serve.models.chattts.random_checkpoint import write_random

pytest.importorskip("openvino")
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return load(tiny_ckpt)


def _hidden(model) -> torch.Tensor:
    return torch.randn(2, 11, model.config.gpt.hidden_size, generator=torch.Generator().manual_seed(3))


def _no_build(monkeypatch):
    def refused(*args, **kwargs):
        raise AssertionError("built again: the cache was not read")

    monkeypatch.setattr(cpu_graph, "_ov_graph", refused)


@pytest.mark.parametrize("runtime", ["ov-fp32", pytest.param("ov-int8", marks=pytest.mark.slow)])
def test_a_graph_is_read_back_from_the_cache_with_the_same_bits(model, tiny_ckpt, tmp_path, monkeypatch, runtime):
    if runtime == "ov-int8":
        pytest.importorskip("nncf")
    h = _hidden(model)
    first = AudioGraph(model, runtime, threads=1, cache_dir=tmp_path).decode(h)
    (entry,) = tmp_path.iterdir()
    assert entry.name == graph_cache.cache_key(tiny_ckpt, runtime)
    assert {p.name for p in entry.iterdir()} == {graph_cache.GRAPH, graph_cache.WEIGHTS, graph_cache.MANIFEST}
    _no_build(monkeypatch)
    again = AudioGraph(load(tiny_ckpt), runtime, threads=1, cache_dir=tmp_path).decode(h)  # a new start
    assert torch.equal(first, again)


def test_without_a_cache_dir_nothing_is_written_or_read(model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    AudioGraph(model, "ov-fp32", threads=1)
    assert list(tmp_path.iterdir()) == []


def test_a_damaged_entry_is_built_again_and_replaced(model, tiny_ckpt, tmp_path):
    h = _hidden(model)
    want = AudioGraph(model, "ov-fp32", threads=1, cache_dir=tmp_path).decode(h)
    weights = tmp_path / graph_cache.cache_key(tiny_ckpt, "ov-fp32") / graph_cache.WEIGHTS
    intact = weights.read_bytes()
    with open(weights, "r+b") as f:  # its size kept, some of its numbers changed: it would load and be wrong
        f.seek(len(intact) // 2)
        f.write(b"\x7f" * 64)
    assert torch.equal(AudioGraph(model, "ov-fp32", threads=1, cache_dir=tmp_path).decode(h), want)
    assert weights.read_bytes() == intact  # replaced by the rebuilt entry


def test_another_checkpoint_gets_its_own_entry(model, tiny_ckpt, tmp_path):
    other = write_random(tmp_path / "other", "tiny", seed=12345)
    AudioGraph(model, "ov-fp32", threads=1, cache_dir=tmp_path / "cache")
    AudioGraph(load(other), "ov-fp32", threads=1, cache_dir=tmp_path / "cache")
    assert graph_cache.cache_key(tiny_ckpt, "ov-fp32") != graph_cache.cache_key(other, "ov-fp32")
    assert len(list((tmp_path / "cache").iterdir())) == 2


def test_int8s_key_follows_the_trunk_its_calibration_runs(tiny_ckpt, tmp_path):
    """ov-int8 calibrates on the GPT's hidden states: a changed GPT is a new key; ov-fp32's key ignores it."""
    import shutil

    from chattts_serve.models.chattts import checkpoint as ck

    copy = tmp_path / "copy"
    shutil.copytree(tiny_ckpt, copy)
    with open(copy / ck.GPT_WEIGHTS, "ab") as f:
        f.write(b"\0")
    pytest.importorskip("nncf")
    assert graph_cache.cache_key(copy, "ov-int8") != graph_cache.cache_key(tiny_ckpt, "ov-int8")
    assert graph_cache.cache_key(copy, "ov-fp32") == graph_cache.cache_key(tiny_ckpt, "ov-fp32")


def test_an_unwritable_cache_dir_costs_only_the_store(model, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    wav = AudioGraph(model, "ov-fp32", threads=1, cache_dir=blocker / "cache").decode(_hidden(model))
    assert wav.shape == (2, 512 * 11 - 256)


def test_the_engine_keeps_its_audio_graph_in_the_configured_dir(tiny_ckpt, tmp_path):
    from chattts_serve import Engine
    from chattts_serve.engine.config import EngineConfig, RunnerConfig

    config = EngineConfig.with_slots(1, audio_dtype="ov-fp32", runner=RunnerConfig(onnx_cache_dir=str(tmp_path)))
    Engine.from_pretrained(tiny_ckpt, config=config)
    assert [p.name for p in tmp_path.iterdir()] == [graph_cache.cache_key(tiny_ckpt, "ov-fp32")]
