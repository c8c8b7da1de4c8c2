"""The shared bench helpers: percentiles, summaries, the one-line JSON output and PNG plots."""

from __future__ import annotations

import datetime
import io
import json
import random
import sys

import numpy as np
import pytest

from chattts_serve.bench import stats

pytestmark = pytest.mark.timeout(60)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_percentile_known_values():
    data = [4.0, 1.0, 3.0, 2.0]  # unsorted on purpose
    assert stats.percentile(data, 0) == 1.0
    assert stats.percentile(data, 100) == 4.0
    assert stats.percentile(data, 50) == pytest.approx(2.5)
    assert stats.percentile(data, 90) == pytest.approx(3.7)
    assert stats.percentile([7.0], 99) == 7.0
    assert stats.percentile(list(range(101)), 99) == pytest.approx(99.0)


def test_percentile_matches_numpy_linear():
    rng = random.Random(1)
    for n in (2, 3, 10, 57):
        data = [rng.uniform(-5, 5) for _ in range(n)]
        for q in (0, 1, 25, 50, 90, 99, 100):
            assert stats.percentile(data, q) == pytest.approx(float(np.percentile(data, q)))


def test_percentile_rejects_bad_input():
    with pytest.raises(ValueError):
        stats.percentile([], 50)
    with pytest.raises(ValueError):
        stats.percentile([1.0], 101)
    with pytest.raises(ValueError):
        stats.percentile([1.0], -1)


def test_summarize():
    s = stats.summarize([1.0, 2.0, 3.0, 4.0, 10.0])
    assert s["n"] == 5
    assert s["mean"] == pytest.approx(4.0)
    assert s["min"] == 1.0 and s["max"] == 10.0
    assert s["p50"] == pytest.approx(3.0)
    assert s["p90"] == pytest.approx(4 + 0.6 * 6)
    assert s["p99"] == pytest.approx(4 + 0.96 * 6)
    empty = stats.summarize([])
    assert empty["n"] == 0
    assert all(empty[k] is None for k in ("mean", "min", "p50", "p90", "p99", "max"))


def test_emit_prints_one_sorted_json_line(capsys):
    stats.emit({"zeta": 1, "alpha": [1.5, float("nan")], "bench": "x"})
    out = capsys.readouterr().out
    assert out.endswith("\n") and out.count("\n") == 1
    data = json.loads(out)
    assert data["alpha"] == [1.5, None]  # NaN is not JSON: it becomes null
    assert data["torch"] and isinstance(data["host"], dict) and data["host"]["cpus"]
    date = datetime.datetime.fromisoformat(data["date"])
    assert date.utcoffset() == datetime.timedelta(0)
    assert list(data) == sorted(data)


def test_emit_keeps_given_metadata():
    buf = io.StringIO()
    stats.emit({"date": "then", "torch": "x", "host": "h"}, stream=buf)
    assert json.loads(buf.getvalue()) == {"date": "then", "torch": "x", "host": "h"}


def test_save_plot_writes_png(tmp_path):
    panels = [
        stats.Panel("TTFB (s)", {"p50": [0.1, 0.2, None], "p99": [0.2, 0.5, 0.9]}),
        stats.Panel("x", {"a": [1, 2, 3]}),
    ]
    path = stats.save_plot(tmp_path / "sub" / "p.png", [1, 4, 16], panels, xlabel="concurrency", title="t", logx=True)
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 1000


def test_save_plot_checks_lengths(tmp_path):
    with pytest.raises(ValueError, match="2 values for 3"):
        stats.save_plot(tmp_path / "p.png", [1, 2, 3], [stats.Panel("y", {"a": [1, 2]})], xlabel="x")
    assert not (tmp_path / "p.png").exists()


def test_missing_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    with pytest.raises(RuntimeError, match="pip install matplotlib"):
        stats.save_plot(tmp_path / "p.png", [1], [stats.Panel("y", {"a": [1]})], xlabel="x")
    with pytest.raises(RuntimeError, match="pip install matplotlib"):
        stats.require_matplotlib()
