"""``bench host-overhead`` through the real CLI at tiny sizes: one JSON line per run, both runners timed
side by side, and the current runner's launches per step flat in the batch (its point)."""

from __future__ import annotations

from pathlib import Path

import chattts_serve.engine.runner as runner_module

from .test_tools import run_cli


def test_host_overhead_cli(tiny_ckpt, capsys):
    before = str(Path(runner_module.__file__))  # any runner.py with the same constructor loads side by side
    r = run_cli(
        capsys,
        "bench",
        "host-overhead",
        "--model",
        str(tiny_ckpt),
        "--sizes",
        "8,16",
        "--steps",
        "2",
        "--before",
        before,
    )
    assert r["launch_us"] > 0 and r["timer_cost_us"] > 0
    assert set(r["sizes"]) == {"8", "16"}
    for row in r["sizes"].values():
        assert set(row) == {"after", "before"}
        for m in row.values():
            assert m["step_ms"] > 0 and m["host_us_per_seq"] >= m["python_us_per_seq"] >= 0
    after = [r["sizes"][n]["after"]["ops_per_step"] for n in ("8", "16")]
    assert after[0] == after[1] > 0
