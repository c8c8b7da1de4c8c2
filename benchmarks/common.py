"""What the benchmark scripts share: the full-size checkpoint they run on, and the reference's side run
as a subprocess in the reference environment (its last stdout line is one JSON object)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from chattts_serve.model.checkpoint import write_random

HERE = Path(__file__).resolve().parent


def full_checkpoint(path: str | Path) -> Path:
    """``path``, written as a full-size random checkpoint (seed 0) if it is not a checkpoint yet."""
    path = Path(path)
    if not (path / "asset").is_dir():
        write_random(path, "full", seed=0)
    return path


def run_reference(reference_python: str, script: str, *args: object, timeout: float = 7200) -> dict:
    """Run ``benchmarks/<script>`` with the reference python; returns its JSON result."""
    res = subprocess.run(
        [reference_python, str(HERE / script), *map(str, args)],
        check=True,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return json.loads(res.stdout.strip().splitlines()[-1])
