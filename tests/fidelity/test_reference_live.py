"""fp32 fidelity against the reference ChatTTS run live (not from golden files).

Runs when CHATTTS_REFERENCE_PYTHON points at the python of a reference environment
(``bash ../shared/oracle/setup_venv.sh .venv-reference``; .ci/run builds one). Uses checkpoints other
than the golden one: the tiny config with another seed, and a "small" config whose heads are 64-dim
like the official model.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from chattts_serve.models.chattts.config import ConvStackConfig, DecoderConfig, GPTConfig, ModelConfig
from chattts_serve.models.chattts.random_checkpoint import write_random

from .cases import build_cases
from .compare import compare_all
from .oracle import run_reference

REFERENCE_PYTHON = os.environ.get("CHATTTS_REFERENCE_PYTHON")

pytestmark = [
    pytest.mark.reference,
    pytest.mark.skipif(not REFERENCE_PYTHON, reason="set CHATTTS_REFERENCE_PYTHON to a reference environment"),
]

SMALL = ModelConfig(
    gpt=GPTConfig(hidden_size=256, num_layers=3, num_heads=4, num_kv_heads=4, intermediate_size=512),
    decoder=DecoderConfig(ConvStackConfig(idim=128, odim=128, hidden=64, num_layers=2, bn_dim=32)),
    dvae=ModelConfig.tiny().dvae,
    vocos=ModelConfig.tiny().vocos,
)


@pytest.mark.parametrize(("size", "seed"), [("tiny", 7), ("small", 3)])
def test_live_reference(tmp_path, size, seed):
    ckpt = write_random(tmp_path / "ckpt", SMALL if size == "small" else size, seed=seed)
    cases = build_cases(ckpt)
    out = tmp_path / "ref.npz"
    run_reference(REFERENCE_PYTHON, ckpt, cases, out, timeout=1500)
    report = compare_all(ckpt, cases, dict(np.load(out)))
    print(json.dumps(report, indent=1))
    assert report["cases"] == len(cases)
