"""Regenerate tests/fidelity/golden/tiny.npz from the reference ChatTTS.

    bash ../shared/oracle/setup_venv.sh .venv-reference        # once: the reference environment
    python scripts/make_golden.py --reference-python .venv-reference/bin/python

Writes the tiny random checkpoint with our own generator (seed GOLDEN_CHECKPOINT_SEED), runs the
reference on every case of tests/fidelity/cases.py through scripts/reference_oracle.py, and stores the
outputs together with the sha256 of every checkpoint file (the test checks the generator still writes
those exact bytes). Versions used: chattts 0.2.5, torch 2.13.0 (CPU), transformers 5.24.0,
vector_quantize_pytorch 1.25.2 (see ../shared/oracle/setup_venv.sh).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "fidelity"))
sys.path.insert(0, str(ROOT / "src"))

from cases import GOLDEN_CHECKPOINT_SEED, build_cases  # noqa: E402
from oracle import run_reference  # noqa: E402

from chattts_serve.models.chattts.random_checkpoint import write_random  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reference-python", required=True)
    ap.add_argument("--out", default=str(ROOT / "tests" / "fidelity" / "golden" / "tiny.npz"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_random(Path(tmp) / "ckpt", "tiny", seed=GOLDEN_CHECKPOINT_SEED)
        run_reference(args.reference_python, ckpt, build_cases(ckpt), Path(args.out))


if __name__ == "__main__":
    main()
