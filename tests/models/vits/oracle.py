"""Run scripts/vits_reference_oracle.py in the reference environment (a subprocess, never an import)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ORACLE = Path(__file__).resolve().parents[3] / "scripts" / "vits_reference_oracle.py"


def run_reference(reference_python: str, ckpt: Path, texts: list[str], cases: list[dict],
                  timeout: float = 900) -> dict[str, np.ndarray]:
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "cases.json", Path(tmp) / "out.npz"
        spec.write_text(json.dumps({"texts": texts, "cases": cases}, ensure_ascii=False), encoding="utf-8")
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        done = subprocess.run([reference_python, str(ORACLE), str(ckpt), str(spec), str(out)], env=env,
                              timeout=timeout, capture_output=True, text=True)
        if done.returncode != 0:
            sys.stderr.write(done.stderr[-4000:])
            raise RuntimeError(f"the reference oracle failed (exit {done.returncode})")
        return dict(np.load(out))
