"""engine/onednn.py: the engine bounds oneDNN's (and ideep's) caches of compiled kernels before it loads
weights, and the bound really caps the memory that new input shapes claim (the soak's growth)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from chattts_serve import Engine
from chattts_serve.engine.config import EngineConfig
from chattts_serve.engine.onednn import CAPACITY_VARIABLES, DEFAULT_CAPACITY, bound_kernel_caches

# 400 row counts through one packed linear: 400 kernels; reports the RSS they added (MB), after trim.
_SHAPES = """
import ctypes, sys, torch
torch.set_num_threads(1)
if sys.argv[1] == "bound":
    from chattts_serve.engine.onednn import bound_kernel_caches
    bound_kernel_caches(16)
from chattts_serve.kernels.linear import pack_weight, packed_linear
packed = pack_weight(torch.randn(256, 256))
def rss():
    return next(float(l.split()[1]) / 1024 for l in open("/proc/self/status") if l.startswith("VmRSS"))
packed_linear(torch.randn(3, 256), packed)
before = rss()
for m in range(1, 400):
    packed_linear(torch.randn(m, 256), packed)
ctypes.CDLL("libc.so.6").malloc_trim(0)
print(rss() - before)
"""


def _growth_mb(mode: str) -> float:
    env = {k: v for k, v in os.environ.items() if k not in CAPACITY_VARIABLES}
    out = subprocess.run(
        [sys.executable, "-c", _SHAPES, mode], env=env, capture_output=True, text=True, timeout=300, check=True
    )
    return float(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and glibc's malloc_trim")
@pytest.mark.slow
def test_the_bound_caps_what_new_shapes_hold():
    unbounded, bounded = _growth_mb("default"), _growth_mb("bound")
    # Measured: ~140 MB unbounded (two caches of up to 1024 kernels, ~0.35 MB per shape), ~5 MB bounded.
    assert unbounded > 40, unbounded
    assert bounded < unbounded / 4, (bounded, unbounded)


def test_the_engine_sets_the_bound_and_a_user_setting_wins(tiny_ckpt, monkeypatch):
    for name in CAPACITY_VARIABLES:
        monkeypatch.setenv(name, "0")  # so that monkeypatch restores the variable's state afterwards
        monkeypatch.delenv(name)
    Engine.from_pretrained(tiny_ckpt, config=EngineConfig.with_slots(1))
    assert all(os.environ[name] == str(DEFAULT_CAPACITY) for name in CAPACITY_VARIABLES)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "8")
    assert bound_kernel_caches() == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": DEFAULT_CAPACITY, "LRU_CACHE_CAPACITY": 8}
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "lots")
    with pytest.raises(ValueError, match="LRU_CACHE_CAPACITY must be an integer"):
        bound_kernel_caches()
    with pytest.raises(ValueError, match=">= 0"):
        bound_kernel_caches(-1)
