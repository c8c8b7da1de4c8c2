"""Regenerate tests/models/kokoro/golden/tiny.npz from the reference ``kokoro`` package (0.9.4).

    python scripts/make_kokoro_golden.py --reference-python .venv-reference/bin/python

Writes the tiny random Kokoro checkpoint with our own generator (seed GOLDEN_CHECKPOINT_SEED), runs the
package on every case of tests/models/kokoro/cases.py through scripts/kokoro_reference_oracle.py (fp32,
CPU, one thread), and stores its outputs with the sha256 of every checkpoint file (the test checks the
generator still writes those bytes). Versions used: kokoro 0.9.4, torch 2.13.0 (CPU), transformers 5.24.0.
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

from tests.models.kokoro.cases import CASES, GOLDEN_CHECKPOINT_SEED  # noqa: E402
from tests.models.kokoro.oracle import run_reference  # noqa: E402

from chattts_serve.models.kokoro.random_checkpoint import write_random  # noqa: E402

GOLDEN = ROOT / "tests" / "models" / "kokoro" / "golden" / "tiny.npz"


def file_hashes(ckpt: Path) -> dict[str, str]:
    return {str(p.relative_to(ckpt)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(ckpt.rglob("*")) if p.is_file()}


AUDIO_STRIDE = 4  # keep every 4th sample (and the sha256 of all of them): the file stays ~100 kB


def shrink(outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Waveforms cut to every AUDIO_STRIDE-th sample, with their length and the sha256 of the full float32
    bytes, so the test checks a bound on the kept samples and reports whether the rest is bit-exact."""
    out = {}
    for key, value in outputs.items():
        if key.endswith("/audio"):
            audio = np.ascontiguousarray(value, dtype=np.float32)
            out[key] = audio[::AUDIO_STRIDE]
            out[key + "_len"] = np.array(audio.shape[0])
            out[key + "_sha256"] = np.array(hashlib.sha256(audio.tobytes()).hexdigest())
        else:
            out[key] = value
    out["meta/audio_stride"] = np.array(AUDIO_STRIDE)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference-python", required=True)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_random(Path(tmp) / "ckpt", "tiny", seed=GOLDEN_CHECKPOINT_SEED)
        outputs = shrink(run_reference(args.reference_python, ckpt, CASES))
        outputs["meta/files"] = np.array(json.dumps(file_hashes(ckpt)))
        outputs["meta/cases"] = np.array(json.dumps(CASES))
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(GOLDEN, **outputs)
    print(f"wrote {GOLDEN} ({GOLDEN.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
