"""server.metrics: the decode-step counters read from ``EngineStats`` at scrape time."""

from __future__ import annotations

from types import SimpleNamespace

from chattts_serve.engine.core import EngineStats
from chattts_serve.server.metrics import Metrics


class _Engine:
    family = SimpleNamespace(name="chattts")
    sample_rate = 24000

    def __init__(self) -> None:
        self.value = EngineStats(0, 0, 4, 0)

    def stats(self) -> EngineStats:
        return self.value


def test_graph_replays_and_eager_steps_are_exported():
    engine = _Engine()
    metrics = Metrics(engine)
    engine.value = EngineStats(1, 0, 4, 1, graph_replays=7, eager_steps=2, graphs_refused=1)
    text = metrics.render().decode()
    assert "chattts_cuda_graph_replays_total 7.0" in text
    assert "chattts_decode_eager_steps_total 2.0" in text
    assert "chattts_cuda_graphs_refused_total 1.0" in text
    assert 'chattts_model_info{family="chattts",sample_rate="24000"} 1.0' in text
