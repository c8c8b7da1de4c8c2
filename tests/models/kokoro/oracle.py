"""Run scripts/kokoro_reference_oracle.py in the reference environment (a subprocess, never an import)."""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

import numpy as np

ORACLE = Path(__file__).resolve().parents[3] / "scripts" / "kokoro_reference_oracle.py"


def run_reference(reference_python: str, ckpt: Path, cases: list[dict], timeout: float = 900) -> dict[str, np.ndarray]:
    with tempfile.TemporaryDirectory() as tmp:
        cases_path, out = Path(tmp) / "cases.json", Path(tmp) / "out.npz"
        cases_path.write_text(json.dumps(cases))
        subprocess.run([reference_python, str(ORACLE), str(ckpt), str(cases_path), str(out)], check=True,
                       timeout=timeout, capture_output=True)
        return dict(np.load(out))
