"""Shared fixtures. Tests run on CPU with one torch thread (timings on shared 2-core machines drift,
and tests check behaviour, not speed)."""

from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(1)
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach the network

TINY_SEED = 0


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """The tiny random checkpoint (official layout), written once per test run."""
    from chattts_serve.model.random_checkpoint import write_random

    return write_random(tmp_path_factory.mktemp("ckpt") / "tiny", "tiny", seed=TINY_SEED)


@pytest.fixture(scope="session")
def tiny_engine(tiny_ckpt):
    from chattts_serve import Engine
    from chattts_serve.engine.config import EngineConfig

    return Engine.from_pretrained(tiny_ckpt, device="cpu", config=EngineConfig.with_slots(8))
