"""fp32 fidelity against kokoro 0.9.4 run live (not from golden files), on checkpoints other than the golden.

Runs when CHATTTS_REFERENCE_PYTHON points at the python of the reference environment (the same variable
as the ChatTTS live test: one environment holds both packages).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from chattts_serve.models.kokoro.random_checkpoint import write_random

from .cases import CASES
from .compare import max_differences
from .oracle import run_reference

REFERENCE_PYTHON = os.environ.get("CHATTTS_REFERENCE_PYTHON")

pytestmark = [
    pytest.mark.reference,
    pytest.mark.slow,
    pytest.mark.skipif(not REFERENCE_PYTHON, reason="set CHATTTS_REFERENCE_PYTHON to a reference environment"),
]

# Longer utterances than the golden ones, odd speeds, a seed per case.
LIVE_CASES = CASES + [
    {"ids": [0, *([43, 156, 62, 83, 16, 55, 102, 4] * 12), 0], "voice": "af_sky", "speed": 1.1, "seed": 99},
    {"ids": [0, 102, 0], "voice": "zm_yunjian", "speed": 0.5, "seed": 0},
]


@pytest.mark.parametrize("seed", [5])
def test_live_reference(tmp_path, seed):
    ckpt = write_random(tmp_path / "ckpt", "tiny", seed=seed)
    reference = run_reference(REFERENCE_PYTHON, ckpt, LIVE_CASES)
    report = max_differences(reference, LIVE_CASES, ckpt)
    print(json.dumps(report, indent=1))
    for i in range(len(LIVE_CASES)):
        assert report[f"{i}/durations"] == 0
    assert max(report.values()) <= 1e-5, report
    assert np.isfinite(list(report.values())).all()


def test_reference_bench_keeps_the_protocol(tmp_path):
    """models/kokoro/reference_bench.py under the reference python: bench/family.py's protocol, and the package
    speaks the bench's texts as long as our engine does (the same sentences, durations exact)."""
    from chattts_serve.bench import family as bench_family
    from chattts_serve.engine.engine import Engine
    from chattts_serve.models import get
    from chattts_serve.sampling_params import SamplingParams

    ckpt = write_random(tmp_path / "ckpt", "tiny", seed=3, voices=("zf_xiaobei",))
    reqs, _ = bench_family.requests("zh", 2, "zf_xiaobei")
    jobs = {"threads": 1, "rounds": 2, "requests": reqs}
    out = bench_family.run_reference(REFERENCE_PYTHON, bench_family.reference_script(get("kokoro")), ckpt, jobs)
    assert out["package"] == "kokoro 0.9.4" and out["threads"] == 1
    assert len(out["single_s"]) == len(out["sequential_s"]) == 2 and len(out["audio_s"]) == 3
    engine = Engine.from_pretrained(ckpt)
    ours = engine.synthesize([r["text"] for r in reqs],
                             [SamplingParams(seed=r["seed"], speaker="zf_xiaobei", lang="zh") for r in reqs])
    assert [round(r.duration, 4) for r in ours] == out["audio_s"]
