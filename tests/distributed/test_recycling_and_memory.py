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
    budget = MemoryBudget(total_bytes=80 * 2**30, fraction=0.25, weights_bytes=2 * 2**30, bytes_per_slot=100 * MiB)
    # 20 GiB share, 1 GiB of it for the CUDA context -> 19 GiB allocator cap, 25 % reserve -> 14.25 GiB,
    # minus 2 GiB of weights -> 12.25 GiB / 100 MiB = 125 slots
    assert budget.cap_bytes == 20 * 2**30 and budget.allocator_bytes == 19 * 2**30
    assert budget.num_slots(max_slots=1000) == 125
    assert budget.num_slots(max_slots=16) == 16  # never more than configured
    tight = MemoryBudget(total_bytes=8 * 2**30, fraction=0.1, weights_bytes=2 * 2**30, bytes_per_slot=MiB)
    with pytest.raises(ValueError, match="no room"):
        tight.num_slots(16)
    with pytest.raises(ValueError, match="max_memory_fraction"):
        MemoryBudget(8, 1.5, 1, 1)
    no_context = MemoryBudget(80 * 2**30, 0.25, 2 * 2**30, 100 * MiB, context_bytes=0)  # configurable
    assert no_context.num_slots(max_slots=1000) == 133
    small = MemoryBudget(total_bytes=2 * 2**30, fraction=0.5, weights_bytes=0, bytes_per_slot=MiB)
    with pytest.raises(ValueError, match="MiB for the CUDA context"):  # the whole share is the context
        small.num_slots(16)


def test_replica_fractions_adding_up_to_one_leave_room_for_each_context():
    total = 141 * 2**30
    budgets = [MemoryBudget(total, f, 4 * 2**30, 100 * MiB) for f in (0.5, 0.25, 0.25)]
    assert sum(b.allocator_bytes + b.context_bytes for b in budgets) <= total
    assert all(b.allocator_fraction * total == b.cap_bytes - 2**30 for b in budgets)


def _fake_cuda(monkeypatch, total: int) -> list[tuple]:
    import types

    import torch

    capped: list[tuple] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(total_memory=total))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d: capped.append((f, d)))
    return capped


def test_budget_sizes_kv_slots_by_the_kv_cache_dtype(tiny_ckpt, monkeypatch):
    import torch

    from chattts_serve.distributed.memory import budget_for
    from chattts_serve.engine.config import EngineConfig, RunnerConfig
    from chattts_serve.engine.slot_memory import slot_cost
    from chattts_serve.models.chattts import checkpoint
    from chattts_serve.models.chattts.gpt import KVCache

    _fake_cuda(monkeypatch, 80 * 2**30)
    g = checkpoint.read_config(tiny_ckpt).gpt
    fp32 = EngineConfig.with_slots(4)
    bf16_kv = EngineConfig.with_slots(4, runner=RunnerConfig(kv_cache_dtype="bf16"))
    dev = torch.device("cuda", 0)
    max_len = fp32.scheduler.max_model_len
    full = budget_for(str(tiny_ckpt), fp32, dev, 0.5).bytes_per_slot
    assert full == slot_cost(g, max_len, torch.float32, graphs=True).total  # a CUDA budget: graphs' pool too
    half = budget_for(str(tiny_ckpt), bf16_kv, dev, 0.5).bytes_per_slot
    rest = full - KVCache.bytes_per_slot(g, max_len + 1, torch.float32)  # hidden-state row and graphs: fp32 always
    assert half == KVCache.bytes_per_slot(g, max_len + 1, torch.bfloat16) + rest


def test_cap_device_memory_caps_the_allocator_below_the_share(tiny_ckpt, monkeypatch):
    from chattts_serve.distributed.memory import cap_device_memory
    from chattts_serve.engine.config import EngineConfig

    total = 80 * 2**30
    capped = _fake_cuda(monkeypatch, total)
    config = cap_device_memory(str(tiny_ckpt), EngineConfig.with_slots(8), "cuda:1", 0.5)
    [(fraction, device)] = capped
    assert fraction == (total // 2 - 2**30) / total and str(device) == "cuda:1"
    assert config.scheduler.max_num_seqs == 8 and not config.auto_slots
    cap_device_memory(str(tiny_ckpt), EngineConfig.with_slots(8), "cuda:0", 0.5, context_reserve=0)
    assert capped[-1][0] == 0.5


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
