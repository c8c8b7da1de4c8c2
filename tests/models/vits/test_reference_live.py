"""fp32 fidelity against transformers' VitsTokenizer / VitsModel run live, on checkpoints other than the golden.

Runs when CHATTTS_REFERENCE_PYTHON points at the python of the reference environment (the same variable as
the ChatTTS and Kokoro live tests: one environment holds all three). The oracle refuses a checkpoint that
transformers does not load completely (missing, unexpected or mismatched tensors).
"""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import pytest

from chattts_serve.models.vits.random_checkpoint import write_random

from .cases import CASES, TEXTS
from .compare import differences, ours
from .oracle import run_reference

REFERENCE_PYTHON = os.environ.get("CHATTTS_REFERENCE_PYTHON")

pytestmark = [
    pytest.mark.reference,
    pytest.mark.slow,
    pytest.mark.skipif(not REFERENCE_PYTHON, reason="set CHATTTS_REFERENCE_PYTHON to a reference environment"),
]

LONG = "Massively multilingual speech: one thousand one hundred languages, spoken by a random network. " * 3
LIVE_CASES = CASES + [
    {"text": LONG, "speaking_rate": 1.1, "noise_scale": 0.8, "noise_scale_duration": 0.6, "seed": 99},
    {"text": "a", "speaking_rate": 0.5, "noise_scale": 0.667, "noise_scale_duration": 0.8, "seed": 0},
    {"ids": [0, 6, 0, 7, 0, 37, 0], "speaking_rate": 3.0, "noise_scale": 2.0, "noise_scale_duration": 2.0,
     "seed": 2**31 - 1},
]


def _check(ckpt, texts, cases):
    reference = run_reference(REFERENCE_PYTHON, ckpt, texts, cases)
    mine = ours(ckpt, texts, cases)
    for key in reference:
        if key.endswith(("/ids", "/durations")):
            np.testing.assert_array_equal(mine[key], reference[key], err_msg=key)
    report = differences(reference, mine)
    print(json.dumps(report, indent=1))
    assert max(report.values(), default=0.0) == 0.0, report  # bit-exact, as on the golden checkpoint


@pytest.mark.parametrize("seed", [5])
def test_live_tiny(tmp_path, seed):
    _check(write_random(tmp_path / "ckpt", "tiny", seed=seed), TEXTS, LIVE_CASES)


def test_live_multi_speaker(tmp_path):
    ckpt = write_random(tmp_path / "ckpt", "tiny", seed=6, num_speakers=3, speaker_embedding_size=8)
    cases = [{**CASES[0], "speaker_id": s} for s in (0, 2)] + [CASES[1]]  # the last without a speaker
    _check(ckpt, [], cases)


def test_live_deterministic_durations(tmp_path):
    ckpt = write_random(tmp_path / "ckpt", "tiny", seed=7, use_stochastic_duration_prediction=False)
    _check(ckpt, [], CASES[:2])


def test_live_full_size(tmp_path):
    """The MMS-TTS-sized checkpoint: every tensor loads in transformers, one sentence is bit-exact."""
    _check(write_random(tmp_path / "ckpt", "full", seed=8), [], CASES[:1])


def _has_uroman(python: str) -> bool:
    return subprocess.run([python, "-c", "import uroman"], capture_output=True, timeout=60).returncode == 0


def test_live_uroman(tmp_path):
    import sys

    if not (_has_uroman(sys.executable) and _has_uroman(REFERENCE_PYTHON)):
        pytest.skip("uroman is not installed in both environments (pip install uroman)")
    ckpt = write_random(tmp_path / "ckpt", "tiny", seed=9)
    settings = json.loads((ckpt / "tokenizer_config.json").read_text())
    settings.update(is_uroman=True, language="rus")
    (ckpt / "tokenizer_config.json").write_text(json.dumps(settings))
    texts = ["Привет, мир!", "hello мир", "你好 world", "Ελληνικά κείμενο", "plain ascii"]
    _check(ckpt, texts, [{**CASES[0], "text": "Привет, мир!"}])


def test_reference_bench_times_transformers_on_the_jobs(vits_tiny, tmp_path):
    """``models/vits/reference_bench.py`` (the bench's reference side) under the reference python: one JSON line
    with a time per round, and each request's audio length as transformers makes it (durations are ours exactly in
    fp32, so the lengths agree with ours)."""
    import torch

    from chattts_serve.models.vits import reference_bench
    from chattts_serve.models.vits.checkpoint import load
    from chattts_serve.models.vits.model import Utterance
    from chattts_serve.models.vits.tokenizer import VitsTokenizer

    requests = [
        {"text": "hello world", "voice": None, "lang": "en", "seed": 1},
        {"text": "the quick brown fox", "voice": "default", "lang": "en", "seed": 2, "speaking_rate": 1.5},
        {"text": "a", "seed": 3},
    ]
    jobs = tmp_path / "jobs.json"
    jobs.write_text(json.dumps({"threads": 1, "rounds": 2, "requests": requests}))
    done = subprocess.run([REFERENCE_PYTHON, "-I", reference_bench.__file__, str(vits_tiny), str(jobs)],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["package"].startswith("transformers ") and result["package"].endswith(" VitsModel")
    assert len(result["single_s"]) == len(result["sequential_s"]) == 2
    assert all(s > 0 for s in result["single_s"] + result["sequential_s"])
    model, tokenizer = load(vits_tiny), VitsTokenizer.from_dir(vits_tiny)
    for request, seconds in zip(requests, result["audio_s"], strict=True):
        utt = Utterance(tokenizer.encode(request["text"]), speaking_rate=request.get("speaking_rate"),
                        generator=torch.Generator().manual_seed(request["seed"]))
        assert seconds == len(model.synthesize([utt])[0].audio) / model.config.sample_rate
