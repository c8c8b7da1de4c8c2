"""``scripts/gpu_check.py``'s families check down its GPU path on the CPU: the families' graphs per bucket stood in
for (``wanted`` and the capture), so the graph report, the graphs-vs-eager audio and both throughput runs (with
the graphs, then with them set aside) run as they will on a lent GPU, at tiny sizes, and without a G2P (Kokoro
speaks phonemes: the GPU machine has neither misaki nor espeak-ng)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from chattts_serve.engine import bucket_graphs
from tests.support.graph_capture import StandInCapture

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


@pytest.mark.parametrize("family", [pytest.param("kokoro", marks=pytest.mark.slow), "vits"])
def test_the_families_check_reports_graphs_and_both_runs(gpu_check, family, monkeypatch):
    from chattts_serve.models.kokoro import graphs as kokoro_graphs
    from chattts_serve.models.vits import graphs as vits_graphs

    monkeypatch.setattr(bucket_graphs, "wanted", lambda device, config: config.runner.cuda_graphs)
    for cls in (kokoro_graphs.KokoroGraphs, vits_graphs.VitsGraphs):
        real = cls.__init__
        monkeypatch.setattr(cls, "__init__", lambda self, model, max_rows, strict=False, real=real: real(
            self, model, max_rows, strict, (16, 256), capture=StandInCapture()))
    from chattts_serve.models.kokoro import text as kokoro_text

    def no_g2p(*a, **k):  # the GPU machine has no G2P (misaki, spaCy, espeak-ng): Kokoro gets phonemes
        raise AssertionError("the families check must not need a G2P")

    monkeypatch.setattr(kokoro_text, "G2P", no_g2p)
    emitted: list[dict] = []
    r = gpu_check.check_family(family, "cpu", quick=True, emit=emitted.append)
    # the main row first (kept if the deadline cuts the eager run), then the eager run with the speedup
    assert [e["check"] for e in emitted] == ["family_throughput", "family_eager"]
    assert set(emitted[0]["runs"]) == {"graphs"} and emitted[1]["passed"] and "graphs_speedup" in emitted[1]
    assert r["passed"], r
    assert r["graphs"]["captured"] > 0 and r["graphs"]["refused"] == 0
    assert r["graphs"]["max_replay_vs_eager"] == 0.0  # the stand-in replays the very forward
    assert r["graphs_vs_eager_audio"]["lengths_equal"] and r["graphs_vs_eager_ok"]
    assert set(r["runs"]) == {"graphs", "eager"} and r["runs"]["graphs"]["graph_replays"] > 0
    assert r["audio_s_per_s"] == r["runs"]["graphs"]["audio_s_per_s"] and "graphs_speedup" in r
    values = gpu_check.goal_values([r], quick=True)
    assert values["family_graphs_refused"] == 0 and values["family_graph_audio_equals_eager"] is True
