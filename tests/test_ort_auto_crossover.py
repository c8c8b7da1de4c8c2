"""``scripts/ort_auto_crossover.py``: it runs on the tiny checkpoint and picks, from its medians, the
smallest width from which int8 stays ahead."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "ort_auto_crossover.py"


def _load():
    spec = importlib.util.spec_from_file_location("ort_auto_crossover", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_crossover_is_where_int8_stays_ahead():
    crossover = _load().crossover

    def rows(*pairs):
        return {w: {"int4": a, "int8": b} for w, (a, b) in zip((1, 2, 4, 8), pairs, strict=True)}

    assert crossover(rows((1, 2), (2, 3), (4, 3), (8, 5))) == 4
    assert crossover(rows((1, 2), (3, 2), (4, 5), (8, 5))) == 8  # int8 ahead at 2, behind again at 4
    assert crossover(rows((2, 1), (3, 2), (4, 3), (8, 5))) == 1
    assert crossover(rows((1, 2), (2, 3), (3, 4), (4, 5))) == 9  # never: past the widest


def test_script_runs_on_the_tiny_checkpoint(tiny_ckpt, onnx_cache_dir, monkeypatch, capsys):
    """The script's main with its command line, in this process (a fresh interpreter would cost seconds of
    torch and ONNX Runtime imports for the same run)."""
    pytest.importorskip("onnxruntime", reason="the ort-* precisions need the [onnx] extra")
    args = ["--model", str(tiny_ckpt), "--widths", "1,3", "--pairs", "2", "--threads", "1"]
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), *args, "--onnx-cache-dir", onnx_cache_dir])
    _load().main()
    out = capsys.readouterr().out
    r = json.loads(out.strip().splitlines()[-1])
    assert set(r["ms"]) == {"1", "3"} and all(v["int4"] > 0 and v["int8"] > 0 for v in r["ms"].values())
    assert r["crossover"] in (1, 3, 4) and r["cpu_kind"] in ("amx", "avx512_vnni", "avx2", "other")
