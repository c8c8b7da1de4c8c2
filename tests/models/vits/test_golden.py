"""fp32 fidelity against transformers' VitsTokenizer / VitsModel on every CI run, from outputs it recorded.

``scripts/make_vits_golden.py`` ran transformers 5.24.0 (``scripts/vits_reference_oracle.py``) on the tiny
checkpoint our ``write_random`` writes with GOLDEN_CHECKPOINT_SEED. Here we regenerate that checkpoint, check it
is byte-identical to the one transformers saw, and compare: token ids and durations exact, the waveform
bit-exact (the same kernels on the same shapes in the same order; the sha256 of each waveform is checked).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from chattts_serve.models.vits.random_checkpoint import write_random

from .cases import CASES, GOLDEN_CHECKPOINT_SEED, TEXTS
from .compare import differences, ours

GOLDEN = Path(__file__).parent / "golden" / "tiny.npz"


@pytest.fixture(scope="module")
def golden():
    return dict(np.load(GOLDEN))


@pytest.fixture(scope="module")
def golden_ckpt(tmp_path_factory, golden):
    ckpt = write_random(tmp_path_factory.mktemp("vits-golden") / "ckpt", "tiny", seed=GOLDEN_CHECKPOINT_SEED)
    actual = {str(p.relative_to(ckpt)): hashlib.sha256(p.read_bytes()).hexdigest()
              for p in sorted(ckpt.rglob("*")) if p.is_file()}
    assert actual == json.loads(str(golden["meta/files"])), (
        "write_random no longer writes the checkpoint the golden outputs were made from; "
        "if the change is intended, regenerate them with scripts/make_vits_golden.py"
    )
    return ckpt


def test_golden_cases_are_the_recorded_ones(golden):
    assert json.loads(str(golden["meta/cases"])) == {"texts": TEXTS, "cases": CASES}


def test_matches_transformers(golden_ckpt, golden):
    mine = ours(golden_ckpt, TEXTS, CASES)
    for i in range(len(TEXTS)):
        np.testing.assert_array_equal(mine[f"texts/{i}/ids"], golden[f"texts/{i}/ids"], err_msg=repr(TEXTS[i]))
    for i in range(len(CASES)):
        np.testing.assert_array_equal(mine[f"{i}/ids"], golden[f"{i}/ids"])
        np.testing.assert_array_equal(mine[f"{i}/durations"], golden[f"{i}/durations"])
        assert mine[f"{i}/audio"].shape == golden[f"{i}/audio"].shape
    report = differences(golden, mine)
    print(json.dumps(report, indent=1))
    assert max(report.values()) == 0.0, report
    for i in range(len(CASES)):
        assert hashlib.sha256(mine[f"{i}/audio"].tobytes()).hexdigest() == str(golden[f"{i}/audio_sha256"])


def test_random_output_is_not_saturated(golden):
    """The point of scaling the decoder's last conv: no sample pinned at +-1 by the tanh, a peak near 0.25."""
    for i in range(len(CASES)):
        audio = golden[f"{i}/audio"]
        assert np.abs(audio).max() < 0.9
        assert np.abs(audio).max() > 1e-3
