"""``scripts/gpu_check.py`` runs its whole sequence on a CPU with tiny sizes, so it still works the
next time a GPU is lent (its CUDA-only parts: the graphs themselves and fp16)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"


def _pythonpath() -> dict[str, str]:
    return {"PYTHONPATH": os.environ["PYTHONPATH"]} if os.environ.get("PYTHONPATH") else {}


@pytest.mark.timeout(300)
def test_gpu_check_quick_on_cpu(tiny_ckpt, tmp_path):
    out = tmp_path / "results.jsonl"
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--model", str(tiny_ckpt), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=280,
        # PYTHONPATH passes through: a worktree's src/ ahead of the editable install.
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", **_pythonpath()},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    checks = [r["check"] for r in lines]
    assert checks == [
        "environment",
        "cuda_graph_vs_eager",
        "precision_vs_fp32",
        "offline",
        "streams",
        "audio_overlap",
        "summary",
    ]
    assert lines[1]["codes_identical"] and lines[-1]["passed"]
    assert lines[1]["graph_replays"] == 0 and lines[1]["eager_fallbacks"] > 0  # no graphs on a CPU
    assert lines[3]["audio_s_per_s"] > 0 and lines[4]["levels"][0]["n"] == 1
    assert lines[5]["codes_identical"] and lines[5]["overlap_wall_s"] > 0


def test_gpu_check_refuses_cuda_without_a_gpu(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("has CUDA")
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path / "r.jsonl")], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 2 and "no CUDA device" in res.stderr
