"""Regenerate tests/models/vits/golden/tiny.npz from transformers' VitsTokenizer / VitsModel.

    python scripts/make_vits_golden.py --reference-python /work/main/.venv-reference/bin/python

Writes the tiny random VITS checkpoint with our own generator (seed GOLDEN_CHECKPOINT_SEED), runs transformers on
every text and case of tests/models/vits/cases.py through scripts/vits_reference_oracle.py (fp32, CPU, one
thread, HF_HUB_OFFLINE=1), and stores its outputs with the sha256 of every checkpoint file (the test checks the
generator still writes those bytes). Versions used: transformers 5.24.0, torch 2.13.0 (CPU).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "src"))

from tests.models.vits.cases import CASES, GOLDEN_CHECKPOINT_SEED, TEXTS  # noqa: E402
from tests.models.vits.oracle import run_reference  # noqa: E402

from chattts_serve.models.vits.random_checkpoint import write_random  # noqa: E402

GOLDEN = ROOT / "tests" / "models" / "vits" / "golden" / "tiny.npz"


def file_hashes(ckpt: Path) -> dict[str, str]:
    return {str(p.relative_to(ckpt)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(ckpt.rglob("*")) if p.is_file()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference-python", required=True)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_random(Path(tmp) / "ckpt", "tiny", seed=GOLDEN_CHECKPOINT_SEED)
        outputs = run_reference(args.reference_python, ckpt, TEXTS, CASES)
        for key in [k for k in outputs if k.endswith("/audio")]:
            outputs[key + "_sha256"] = np.array(hashlib.sha256(outputs[key].tobytes()).hexdigest())
        outputs["meta/files"] = np.array(json.dumps(file_hashes(ckpt)))
        outputs["meta/cases"] = np.array(json.dumps({"texts": TEXTS, "cases": CASES}, ensure_ascii=False))
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(GOLDEN, **outputs)
    print(f"wrote {GOLDEN} ({GOLDEN.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
