"""VITS fixtures: the tiny random checkpoint (MMS-TTS hub layout) written once per run, and its model."""

from __future__ import annotations

import pytest

VITS_TINY_SEED = 0


@pytest.fixture(scope="session")
def vits_tiny(tmp_path_factory):
    from chattts_serve.models.vits.random_checkpoint import write_random

    return write_random(tmp_path_factory.mktemp("vits") / "tiny", "tiny", seed=VITS_TINY_SEED)


@pytest.fixture(scope="session")
def vits_model(vits_tiny):
    from chattts_serve.models.vits.checkpoint import load

    return load(vits_tiny)


@pytest.fixture(scope="session")
def vits_tokenizer(vits_tiny):
    from chattts_serve.models.vits.tokenizer import VitsTokenizer

    return VitsTokenizer.from_dir(vits_tiny)
