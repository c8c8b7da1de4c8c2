"""Run scripts/reference_oracle.py in the reference environment on a list of cases."""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

ORACLE = Path(__file__).resolve().parents[2] / "scripts" / "reference_oracle.py"


def run_reference(reference_python: str, ckpt: Path, cases: list[dict], out: Path, timeout: float = 1800) -> None:
    """Writes the reference's outputs for ``cases`` on ``ckpt`` to the npz ``out``."""
    with tempfile.TemporaryDirectory() as tmp:
        cases_path = Path(tmp) / "cases.json"
        cases_path.write_text(json.dumps(cases))
        subprocess.run(
            [reference_python, str(ORACLE), str(ckpt), str(cases_path), str(out)], check=True, timeout=timeout
        )
