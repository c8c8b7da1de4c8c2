"""``bench host-overhead`` through the real CLI at tiny sizes: one JSON line per run, the eager step, the
whole-step graph's host side and an older runner timed side by side, launches per step flat in the
batch (its point), and far fewer with the step graph."""

from __future__ import annotations

from pathlib import Path

import chattts_serve.engine.runner as runner_module

from .test_tools import run_cli


def overhead(capsys, tiny_ckpt, sizes: str, steps: str, *flags: str) -> dict:
    """``chattts-serve bench host-overhead`` on the tiny checkpoint: its JSON line."""
    return run_cli(
        capsys, "bench", "host-overhead", "--model", str(tiny_ckpt), "--sizes", sizes, "--steps", steps, *flags
    )


def test_host_overhead_cli(tiny_ckpt, capsys):
    before = str(Path(runner_module.__file__))  # any runner.py with the same constructor loads side by side
    r = overhead(capsys, tiny_ckpt, "8,16", "2", "--before", before)
    assert r["launch_us"] > 0 and r["timer_cost_us"] > 0
    assert r["mix"] == "code" and r["allocator"] in ("caching (glibc mallopt)", "system")
    assert set(r["sizes"]) == {"8", "16"}
    for row in r["sizes"].values():
        assert set(row) == {"eager", "step-graph", "before"}
        for m in row.values():
            assert m["step_ms"] > 0 and m["host_us_per_seq"] >= m["python_us_per_seq"] >= 0
    for name in ("eager", "step-graph"):
        ops = [r["sizes"][n][name]["ops_per_step"] for n in ("8", "16")]
        assert ops[0] == ops[1] > 0
    assert r["sizes"]["16"]["step-graph"]["ops_per_step"] * 5 < r["sizes"]["16"]["eager"]["ops_per_step"]
    assert set(r["fit"]) == {"eager", "step-graph", "before"}
    assert all(set(f) == {"fixed_ms", "marginal_us_per_seq"} for f in r["fit"].values())


def test_fit_recovers_a_line():
    from chattts_serve.bench.host_overhead import fit

    assert fit([64, 256, 512], [2000 + 3 * n for n in (64, 256, 512)]) == {
        "fixed_ms": 2.0,
        "marginal_us_per_seq": 3.0,
    }
    assert fit([64], [100.0]) == {}


def test_mixed_sequences_stay_in_the_step_graph(tiny_ckpt, capsys):
    r = overhead(capsys, tiny_ckpt, "16", "1", "--mix", "mixed", "--allocator", "system", "--paths", "eager,step-graph")
    assert r["allocator"] == "system" and r["mix"] == "mixed"
    row = r["sizes"]["16"]
    assert row["step-graph"]["ops_per_step"] * 10 < row["eager"]["ops_per_step"]  # text rows in the graph too


def test_core_scope_times_the_whole_engine_step(tiny_ckpt, capsys):
    r = overhead(capsys, tiny_ckpt, "4,8", "3", "--scope", "core")
    assert r["scope"] == "core" and r["host_ahead"] == "on" and set(r["sizes"]) == {"4", "8"}
    for row in r["sizes"].values():
        assert set(row) == {"eager", "step-graph"}
        for m in row.values():
            assert m["host_us_per_seq"] >= m["python_us_per_seq"] >= 0 and m["audio_ms"] >= 0
            # The host one step ahead: most of its work is done while the step just queued runs.
            assert m["overlapped_us_per_seq"] > 0 and m["serial_us_per_seq"] > 0
            assert abs(m["serial_us_per_seq"] + m["overlapped_us_per_seq"] - m["host_us_per_seq"]) < 0.05
        assert row["step-graph"]["ops_per_step"] < row["eager"]["ops_per_step"]


def test_core_scope_one_step_at_a_time_is_all_serial(tiny_ckpt, capsys):
    r = overhead(capsys, tiny_ckpt, "4", "2", "--scope", "core", "--paths", "step-graph", "--host-ahead", "off")
    m = r["sizes"]["4"]["step-graph"]
    assert r["host_ahead"] == "off" and m["overlapped_us_per_seq"] == 0
    assert m["serial_us_per_seq"] == m["host_us_per_seq"] > 0
