"""Fidelity on a full-size checkpoint (slow: minutes), run by hand:

    python scripts/fidelity_full.py --ckpt checkpoints/full --reference-python .venv-reference/bin/python

Runs a subset of the fidelity cases (each capped at --max-tokens steps) through the reference and us
and prints the comparison report (max abs differences) as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.fidelity.cases import build_cases  # noqa: E402
from tests.fidelity.compare import compare_all  # noqa: E402
from tests.fidelity.oracle import run_reference  # noqa: E402

from chattts_serve.models.chattts.random_checkpoint import write_random  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", default=str(ROOT / "checkpoints" / "full"))
    ap.add_argument("--reference-python", required=True)
    ap.add_argument("--cases", default="0,1,3,5", help="indices into tests/fidelity/cases.py")
    ap.add_argument("--max-tokens", type=int, default=150)
    args = ap.parse_args()
    ckpt = Path(args.ckpt)
    if not (ckpt / "asset").is_dir():
        write_random(ckpt, "full", seed=0)
    all_cases = build_cases(ckpt)
    cases = []
    for i in map(int, args.cases.split(",")):
        c = dict(all_cases[i])
        c["max_new_tokens"] = min(c.get("max_new_tokens", 2048), args.max_tokens)
        c["min_new_tokens"] = min(c.get("min_new_tokens", 0), c["max_new_tokens"])
        cases.append(c)
    torch.set_num_threads(1)  # as the oracle: fp32 GEMM results depend on the thread count
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ref.npz"
        run_reference(args.reference_python, ckpt, cases, out, timeout=7200)
        report = compare_all(ckpt, cases, dict(np.load(out)))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
