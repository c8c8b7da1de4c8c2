"""``scripts/gpu_check.py`` runs its whole sequence on a CPU with tiny sizes, so it still works the
next time a GPU is lent (its CUDA-only parts: the graphs themselves and fp16); each check in its own
process, so a hang or a crash loses that check only, and the summary is on disk after every check and
after a SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"


def _pythonpath() -> dict[str, str]:
    return {"PYTHONPATH": os.environ["PYTHONPATH"]} if os.environ.get("PYTHONPATH") else {}


ENV = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}


def _quick(tiny_ckpt, out: Path) -> list[str]:
    return [sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--model", str(tiny_ckpt), "--out", str(out)]


@pytest.mark.timeout(300)
def test_gpu_check_quick_on_cpu(tiny_ckpt, tmp_path):
    out = tmp_path / "results.jsonl"
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--self-test", "--model", str(tiny_ckpt), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=280,
        # PYTHONPATH passes through: a worktree's src/ ahead of the editable install.
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", **_pythonpath()},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    by = {}
    for r in lines:
        by.setdefault(r["check"], []).append(r)
    assert [r["check"] for r in lines[:4]] == ["environment", "cuda_graph_vs_eager", "host_syncs", "devices"]
    assert by["devices"][0]["passed"] and by["devices"][0]["second_device"] is None  # no CUDA calls on a CPU
    assert by["precision_vs_fp32"][0]["passed"]
    assert by["cuda_graph_vs_eager"][0]["codes_identical"]
    assert by["cuda_graph_vs_eager"][0]["graph_replays"] == 0  # no graphs on a CPU
    graphs = by["cuda_graph_vs_eager"][0]
    assert graphs["step_graph_codes_identical"] and graphs["step_graph_replays"] == 0
    assert graphs["step_graph_eager_steps"] > 0  # the whole-step function ran (eagerly)
    assert by["host_syncs"][0]["syncs"] is None  # CUDA's sync debug mode: GPU only
    assert by["host_syncs"][0]["waits_per_decode_step"] == 1.0  # the stand-in token event: one wait a step
    assert by["host_overhead"][0]["host_us_per_sequence_step"] > 0
    families = {r["family"]: r for r in by["family_throughput"]}
    assert set(families) == {"kokoro", "vits"}  # every registered batch family but ChatTTS
    assert all(r["passed"] and r["audio_s_per_s"] > 0 for r in families.values())
    plain, mixed = by["offline"]
    assert plain["audio_s_per_s"] > 0 and mixed["mixed_lengths"] and mixed["audio_s"] < plain["audio_s"]
    one, many = by["streams"]
    assert one["levels"][0]["n"] == 1 and many["levels"][0]["seeded"] is False
    assert [r["streams"] for r in by["profile"]] == [1, 2]
    overlap = by["audio_overlap"][0]
    assert overlap["codes_identical"] and overlap["overlap_wall_s"] > 0
    summary = lines[-1]
    assert summary["check"] == "summary" and summary["passed"] and summary["complete"]
    on_disk = json.loads(out.with_suffix(".summary.json").read_text())
    assert on_disk["complete"] and on_disk["goals"] == summary["goals"]
    goals = {g["goal"]: g for g in summary["goals"]}
    # On a CPU only the correctness goals are judged; the speed goals are measured at toy sizes.
    assert goals["graph_replay_equals_eager"]["verdict"] == "pass"
    assert goals["step_graph_equals_eager"]["verdict"] == goals["step_graphs_refused"]["verdict"] == "pass"
    assert goals["offline_256x10s_bf16_wall_s"]["verdict"] == "not judged (quick)"
    assert goals["host_syncs_per_decode_step"]["verdict"] == "not measured"
    assert goals["waits_per_decode_step"]["verdict"] == "pass"  # a correctness goal: judged on the CPU too
    assert goals["host_us_per_seq_step_512"]["verdict"] == "not judged (quick)"
    # The H200's first rung (issue 31, item 12).
    assert goals["first_chunk_1_stream_s"]["threshold"] == "<= 0.05"
    assert goals["first_chunk_p99_512_staggered_s"]["threshold"] == "<= 0.3"
    assert goals["offline_256x10s_bf16_wall_s"]["threshold"] == "<= 3.0"
    assert goals["host_us_per_seq_step_512"]["threshold"] == "<= 15.0"


def test_gpu_check_refuses_cuda_without_a_gpu(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("has CUDA")
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path / "r.jsonl")], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 2 and "no CUDA device" in res.stderr


@pytest.mark.timeout(300)
def test_gpu_check_sh_runs_the_check_into_out(tiny_ckpt, tmp_path):
    """The device machine's entry point: no wheels carried here, so it uses this environment's packages."""
    script = SCRIPT.with_suffix(".sh")
    env = {"OMP_NUM_THREADS": "1", "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    res = subprocess.run(
        ["bash", str(script), "--device", "cpu", "--quick", "--model", str(tiny_ckpt), "--budget-s", "0"],
        capture_output=True,
        text=True,
        timeout=280,
        env={**env, "OUT": str(tmp_path / "out"), **_pythonpath()},
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "torch 2." in res.stdout
    lines = [json.loads(x) for x in (tmp_path / "out" / "gpu_results.jsonl").read_text().splitlines()]
    summary = lines[-1]
    assert summary["check"] == "summary" and summary["passed"]
    # Past the (zero) budget the optional checks are recorded as skipped; the goals' checks still ran, and so
    # did the families' (Kokoro's and VITS's rows: not optional).
    skipped = {r["check"] for r in lines if "skipped" in r}
    assert skipped == {"audio_overlap", "profile"}
    assert {r["family"] for r in lines if r["check"] == "family_throughput" and r["passed"]} == {"kokoro", "vits"}
    assert {g["goal"]: g for g in summary["goals"]}["graph_replay_equals_eager"]["verdict"] == "pass"
    assert (tmp_path / "out" / "gpu_check.log").read_text().strip()
    preflight = json.loads((tmp_path / "out" / "preflight.json").read_text())
    assert preflight["problems"] == [] and not any("Error" in v for v in preflight["imports"].values())
    assert json.loads((tmp_path / "out" / "gpu_results.summary.json").read_text())["complete"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fault, error", [("hang", "timed out after 20 s"), ("exit", "exit code 70")])
def test_a_hung_or_crashed_check_loses_only_itself(tiny_ckpt, tmp_path, fault, error):
    out = tmp_path / "r.jsonl"
    argv = _quick(tiny_ckpt, out) + ["--only", "environment,host_syncs,devices", "--check-timeout-s", "20"]
    res = subprocess.run(
        argv + ["--fault", f"host_syncs:{fault}"],
        capture_output=True,
        text=True,
        timeout=280,
        env={**ENV, **_pythonpath()},
    )
    assert res.returncode == 1, res.stderr[-3000:]
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["check"] for r in lines] == ["environment", "host_syncs", "devices", "summary"]
    assert lines[1]["error"] == error and lines[2]["passed"]  # the check after it still ran
    on_disk = json.loads(out.with_suffix(".summary.json").read_text())
    assert on_disk["complete"] and not on_disk["passed"]


@pytest.mark.timeout(300)
def test_sigterm_writes_the_summary_so_far(tiny_ckpt, tmp_path):
    out, summary = tmp_path / "r.jsonl", tmp_path / "r.summary.json"
    argv = _quick(tiny_ckpt, out) + ["--only", "environment,host_syncs", "--fault", "host_syncs:hang"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**ENV, **_pythonpath()})
    try:
        deadline = time.monotonic() + 200
        while time.monotonic() < deadline:  # until the first check is on disk and the hanging one has begun
            if summary.exists() and "environment" in json.loads(summary.read_text()).get("checks_recorded", []):
                break
            time.sleep(0.2)
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(60)
    finally:
        proc.kill()
    assert rc == 128 + signal.SIGTERM
    on_disk = json.loads(summary.read_text())
    assert on_disk["interrupted"].startswith("signal") and not on_disk["passed"] and not on_disk["complete"]
    assert on_disk["checks_recorded"] == ["environment"]
    assert json.loads(out.read_text().splitlines()[-1])["interrupted"] == on_disk["interrupted"]
