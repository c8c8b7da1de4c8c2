"""fp32 fidelity against the reference ChatTTS 0.2.5, on every CI run.

The golden file was produced by the reference itself (``scripts/make_golden.py`` drives
``scripts/reference_oracle.py`` in the reference environment) on the tiny checkpoint that our own
``write_random`` writes. Here we regenerate that checkpoint, check it is byte-identical to the one the
reference saw, run the same cases through our engine and compare:

* audio codes and refine token ids: identical (every step of every case);
* GPT hidden states, Decoder mel, DVAE mel, Vocos waveform: within 1e-4 max abs (observed: 0);
* DVAE encoder codes and speaker strings: identical.

``test_reference_live.py`` runs the reference live instead, where its environment exists.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from chattts_serve.models.chattts.random_checkpoint import write_random

from .cases import GOLDEN_CHECKPOINT_SEED, build_cases
from .compare import compare_all

GOLDEN = Path(__file__).parent / "golden" / "tiny.npz"


@pytest.fixture(scope="module")
def golden():
    return dict(np.load(GOLDEN))


@pytest.fixture(scope="module")
def golden_ckpt(tmp_path_factory, golden):
    ckpt = write_random(tmp_path_factory.mktemp("golden") / "ckpt", "tiny", seed=GOLDEN_CHECKPOINT_SEED)
    expected = json.loads(str(golden["meta/files"]))
    actual = {
        str(p.relative_to(ckpt)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(ckpt.rglob("*"))
        if p.is_file()
    }
    assert actual == expected, (
        "write_random no longer writes the checkpoint the golden outputs were made from; "
        "if the change is intended, regenerate them with scripts/make_golden.py"
    )
    return ckpt


@pytest.mark.parametrize("host_ahead", ["off", "on"])
def test_golden_matches_reference(golden_ckpt, golden, host_ahead):
    """Also with the host one step ahead of the device (CUDA's default order, run here on the CPU)."""
    torch.manual_seed(0)
    report = compare_all(golden_ckpt, build_cases(golden_ckpt), golden, host_ahead)
    # Keep the measured differences visible in the test log (-rA / -s).
    print(json.dumps(report, indent=1))
    assert report["cases"] == len(build_cases(golden_ckpt))
    assert report["long_cases"] >= 4, "want several cases of >= 100 steps"
    assert report["eos_cases"] >= 2, "want several cases that end on EOS"


def test_encoder_wav_is_well_conditioned(golden_ckpt, golden):
    """Float noise (a 1e-6 relative change of the samples) moves the encoder's rounding margins far less
    than compare.ENCODER_TIE, so a code that differs with a larger margin is a real difference. A pure
    tone failed this by four orders of magnitude: its empty mel bins sit at the log floor."""
    from chattts_serve import Engine
    from chattts_serve.engine.config import EngineConfig

    from .compare import ENCODER_TIE

    dvae = Engine.from_pretrained(golden_ckpt, device="cpu", config=EngineConfig.with_slots(1)).model.dvae
    wav = torch.from_numpy(golden["encoder/wav"])
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        codes, margin = dvae.encode_with_margin(wav)
        for _ in range(3):
            noisy = wav * (1 + 1e-6 * torch.randn(wav.shape, generator=gen))
            codes2, margin2 = dvae.encode_with_margin(noisy)
            moved = float((margin2 - margin)[codes2 == codes].abs().max())
            assert moved < ENCODER_TIE / 10, f"margins moved {moved} under 1e-6 relative noise"
            assert bool(((codes2 == codes) | (margin < ENCODER_TIE)).all())
