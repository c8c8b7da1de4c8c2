"""Recycling policy and the CUDA memory budget, as pure logic (no Ray, no GPU)."""

from __future__ import annotations

import pytest

from chattts_serve.distributed.memory import MemoryBudget, weights_bytes
from chattts_serve.distributed.recycling import RecyclePolicy, Recycler, rss_bytes

MiB = 2**20


def test_policy_reasons():
    p = RecyclePolicy(max_requests=3, max_rss_bytes=100 * MiB, max_cuda_bytes=50 * MiB)
    assert p.reason(2, 10 * MiB, 10 * MiB) is None
    assert "served 3" in p.reason(3, 0, 0)
    assert "RSS" in p.reason(0, 101 * MiB, 0)
    assert "CUDA" in p.reason(0, 0, 51 * MiB)
    assert not RecyclePolicy().enabled and RecyclePolicy().reason(10**9, 10**12, 10**12) is None
    with pytest.raises(ValueError, match="max_requests"):
        RecyclePolicy(max_requests=-1)


def test_recycler_counts_finished_requests_and_stays_tripped():
    rss = [10 * MiB]
    r = Recycler(RecyclePolicy(max_requests=2, max_rss_bytes=50 * MiB), rss=lambda: rss[0], cuda=lambda: 0)
    r.started()
    r.started()
    assert r.in_flight == 2 and r.check() is None  # in flight requests do not count yet
    r.finished()
    assert r.check() is None
    r.finished()
    assert "served 2" in r.check() and r.in_flight == 0
    rss[0] = 0
    assert r.check() is not None  # sticky: a replica that must go stays unhealthy

    grown = Recycler(RecyclePolicy(max_rss_bytes=50 * MiB), rss=lambda: rss[0], cuda=lambda: 0)
    assert grown.check() is None
    rss[0] = 60 * MiB
    assert "RSS" in grown.check()


def test_memory_is_read_only_when_bounded():
    def boom() -> int:
        raise AssertionError("probed")

    assert Recycler(RecyclePolicy(max_requests=5), rss=boom, cuda=boom).check() is None


def test_rss_of_this_process_is_plausible():
    assert 10 * MiB < rss_bytes() < 64 * 2**30


def test_kv_slots_fit_inside_the_fraction():
    budget = MemoryBudget(total_bytes=80 * 2**30, fraction=0.25, weights_bytes=2 * 2**30, kv_bytes_per_slot=100 * MiB)
    # 20 GiB cap, 25 % reserve -> 15 GiB, minus 2 GiB of weights -> 13 GiB / 100 MiB = 133 slots
    assert budget.cap_bytes == 20 * 2**30
    assert budget.num_slots(max_slots=1000) == 133
    assert budget.num_slots(max_slots=16) == 16  # never more than configured
    tight = MemoryBudget(total_bytes=8 * 2**30, fraction=0.1, weights_bytes=2 * 2**30, kv_bytes_per_slot=MiB)
    with pytest.raises(ValueError, match="no room"):
        tight.num_slots(16)
    with pytest.raises(ValueError, match="max_memory_fraction"):
        MemoryBudget(8, 1.5, 1, 1)


def test_weights_bytes_follow_the_precision(tiny_ckpt):
    fp32 = weights_bytes(tiny_ckpt, "fp32")
    bf16 = weights_bytes(tiny_ckpt, "bf16")
    gpt = (tiny_ckpt / "asset/gpt/model.safetensors").stat().st_size
    assert fp32 > bf16 and fp32 - bf16 == gpt - gpt // 2


def test_no_memory_cap_off_cuda(tiny_ckpt):
    from chattts_serve.distributed.memory import cap_device_memory
    from chattts_serve.engine.config import EngineConfig

    config = EngineConfig.with_slots(4)
    assert cap_device_memory(str(tiny_ckpt), config, "cpu", 0.5) is config
    assert cap_device_memory(str(tiny_ckpt), config, "cuda:0", None) is config
