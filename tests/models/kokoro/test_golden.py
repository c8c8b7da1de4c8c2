"""fp32 fidelity against kokoro 0.9.4 on every CI run, from outputs the package itself recorded.

``scripts/make_kokoro_golden.py`` ran the package (``scripts/kokoro_reference_oracle.py``) on the tiny
checkpoint our ``write_random`` writes with GOLDEN_CHECKPOINT_SEED. Here we regenerate that checkpoint,
check it is byte-identical to the one the package saw, run the same cases and compare: durations exact,
F0/energy and the waveform within 1e-5 (observed: bit-exact; the test prints whether the whole waveform's
sha256 matches).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from chattts_serve.models.kokoro.random_checkpoint import write_random

from .cases import CASES, GOLDEN_CHECKPOINT_SEED
from .compare import ours

GOLDEN = Path(__file__).parent / "golden" / "tiny.npz"
BOUND = 1e-5


@pytest.fixture(scope="module")
def golden():
    return dict(np.load(GOLDEN))


@pytest.fixture(scope="module")
def golden_ckpt(tmp_path_factory, golden):
    ckpt = write_random(tmp_path_factory.mktemp("kokoro-golden") / "ckpt", "tiny", seed=GOLDEN_CHECKPOINT_SEED)
    actual = {str(p.relative_to(ckpt)): hashlib.sha256(p.read_bytes()).hexdigest()
              for p in sorted(ckpt.rglob("*")) if p.is_file()}
    assert actual == json.loads(str(golden["meta/files"])), (
        "write_random no longer writes the checkpoint the golden outputs were made from; "
        "if the change is intended, regenerate them with scripts/make_kokoro_golden.py"
    )
    return ckpt


def test_golden_cases_are_the_recorded_ones(golden):
    assert json.loads(str(golden["meta/cases"])) == CASES


def test_matches_the_package(golden_ckpt, golden):
    stride = int(golden["meta/audio_stride"])
    mine = ours(golden_ckpt, CASES)
    report = {}
    for i in range(len(CASES)):
        np.testing.assert_array_equal(mine[f"{i}/durations"], golden[f"{i}/durations"])
        for name in ("f0", "energy"):
            assert mine[f"{i}/{name}"].shape == golden[f"{i}/{name}"].shape
            report[f"{i}/{name}"] = float(np.abs(mine[f"{i}/{name}"] - golden[f"{i}/{name}"]).max())
        audio = mine[f"{i}/audio"]
        assert audio.shape[0] == int(golden[f"{i}/audio_len"])
        report[f"{i}/audio"] = float(np.abs(audio[::stride] - golden[f"{i}/audio"]).max())
        report[f"{i}/audio_bit_exact"] = hashlib.sha256(audio.tobytes()).hexdigest() == str(golden[f"{i}/audio_sha256"])
    print(json.dumps(report, indent=1))
    assert all(v <= BOUND for k, v in report.items() if not k.endswith("bit_exact")), report
