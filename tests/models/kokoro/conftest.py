"""Kokoro fixtures: the tiny random checkpoint (official layout) written once per run, and its model."""

from __future__ import annotations

import pytest

KOKORO_TINY_SEED = 0


@pytest.fixture(scope="session")
def kokoro_tiny(tmp_path_factory):
    from chattts_serve.models.kokoro.random_checkpoint import write_random

    return write_random(tmp_path_factory.mktemp("kokoro") / "tiny", "tiny", seed=KOKORO_TINY_SEED)


@pytest.fixture(scope="session")
def kokoro_model(kokoro_tiny):
    from chattts_serve.models.kokoro.checkpoint import load

    return load(kokoro_tiny)
