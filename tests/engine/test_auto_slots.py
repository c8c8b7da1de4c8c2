"""Auto-sized KV slots (``runner.auto_num_slots``) and the waiting bound that follows the slots."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from chattts_serve.engine.config import EngineConfig
from chattts_serve.engine.runner import (
    AUTO_SLOTS_FRACTION,
    MAX_AUTO_SLOTS,
    auto_num_slots,
    fitted_model_len,
    slot_bytes,
    slots_that_fit,
)
from chattts_serve.engine.scheduler import SchedulerConfig
from chattts_serve.engine.slot_memory import check_slots_fit, slot_cost
from chattts_serve.models.chattts.config import ModelConfig
from chattts_serve.models.chattts.gpt import KVCache

GiB = 1 << 30


def test_an_h200_gets_the_512_slots_that_500_streams_need():
    kv = KVCache.bytes_per_slot(ModelConfig().gpt, 2304, torch.bfloat16)
    assert 72e9 < 512 * kv < 73e9  # the 72.5 GB for 512 slots in bf16
    per_slot = slot_bytes(ModelConfig().gpt, 2304, torch.bfloat16)  # + hidden-state row and headroom
    assert 4.0e9 < 512 * (per_slot - kv) < 4.2e9  # 576 rows of 7.1 MB
    h200_free = 139 * GiB
    assert MAX_AUTO_SLOTS == 512
    assert slots_that_fit(h200_free, AUTO_SLOTS_FRACTION["cuda"], per_slot) == 512
    assert slots_that_fit(h200_free, AUTO_SLOTS_FRACTION["cuda"], per_slot) > 256  # the old cap
    # fp32 KV takes twice the bytes: what fits, below the cap.
    fp32 = slot_bytes(ModelConfig().gpt, 2304, torch.float32)
    assert 300 < slots_that_fit(h200_free, AUTO_SLOTS_FRACTION["cuda"], fp32) < 512


def test_a_slots_bytes_are_the_real_ones_of_the_chosen_dtypes():
    """fp32 keys and values are 283 MB a slot at 2304 positions (and the static step's scratch position),
    and on CUDA the slot's row of the step graphs' pool counts too: an H200's auto slots in fp32 are
    383, not the 385 the cache alone gave."""
    gpt = ModelConfig().gpt
    cost = slot_cost(gpt, 2304, torch.float32, graphs=True)
    assert 283e6 < cost.kv < 284e6 and cost.kv == KVCache.bytes_per_slot(gpt, 2305, torch.float32)
    assert 0 < cost.graphs < 1e6 and slot_cost(gpt, 2304, torch.float32, graphs=False).graphs == 0
    assert slot_bytes(gpt, 2304, torch.float32, graphs=True) == cost.total
    h200_free = 139 * GiB
    assert slots_that_fit(h200_free, AUTO_SLOTS_FRACTION["cuda"], cost.total) == 383
    bf16 = slot_cost(gpt, 2304, torch.bfloat16, graphs=True)
    assert bf16.kv == (cost.kv + 1) // 2 and slots_that_fit(h200_free, AUTO_SLOTS_FRACTION["cuda"], bf16.total) == 512


def test_fixed_slots_that_do_not_fit_are_refused_with_their_real_bytes():
    """``--max-num-seqs 512`` in fp32 on an H200 ran out of memory allocating the cache: refused, naming
    what a slot costs and what fits."""
    cost = slot_cost(ModelConfig().gpt, 2304, torch.float32, graphs=True)
    budget = int(139 * GiB * AUTO_SLOTS_FRACTION["cuda"])
    with pytest.raises(ValueError) as err:
        check_slots_fit(512, cost, budget, 2304)
    msg = str(err.value)
    assert "512 KV slots of 2304 positions need 149.5 GB" in msg
    assert "float32 keys and values 283 MB" in msg and "--max-num-seqs 383 or fewer" in msg and "bf16" in msg
    check_slots_fit(383, cost, budget, 2304)  # what fits passes


def test_a_fitted_length_keeps_every_slot_inside_the_budget(monkeypatch):
    gpt = ModelConfig().gpt

    class Model:
        class config:
            pass

    Model.config.gpt = gpt
    free = 139 * GiB
    dev = torch.device("cuda", 0)
    import chattts_serve.engine.runner as runner_mod

    monkeypatch.setattr(runner_mod, "free_bytes", lambda d: free)
    n = fitted_model_len(Model, 300, 4096, dev, torch.float32)
    assert 2304 < n < 4096
    budget = free * AUTO_SLOTS_FRACTION["cuda"]
    assert 300 * slot_bytes(gpt, n, torch.float32, graphs=True) <= budget < 300 * slot_bytes(
        gpt, n + 1, torch.float32, graphs=True
    )


def test_slots_that_fit_is_bounded_both_ways():
    assert slots_that_fit(10**15, 0.75, 1) == MAX_AUTO_SLOTS
    assert slots_that_fit(0, 0.75, 10**6) == 1
    assert slots_that_fit(100 * 10**6, 0.5, 10**6) == 50


def test_auto_num_slots_on_a_cpu_uses_half_the_free_ram(tiny_ckpt, monkeypatch):
    import os

    from chattts_serve.models.chattts import checkpoint

    model = checkpoint.load(tiny_ckpt)
    per_slot = slot_bytes(model.config.gpt, 512, torch.float32)
    pages = {"SC_AVPHYS_PAGES": 40 * per_slot // 4096, "SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(os, "sysconf", lambda name: pages[name])
    assert auto_num_slots(model, 512, torch.device("cpu"), torch.float32) == 20
    assert auto_num_slots(model, 512, torch.device("cpu"), torch.float32, fraction=0.25) == 10


def test_the_waiting_bound_is_at_least_the_slots():
    assert EngineConfig.with_slots(8).scheduler.max_waiting == 256  # the default, already enough
    assert EngineConfig.with_slots(512).scheduler.max_waiting == 512
    c = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=4, max_waiting=1000))
    assert c.scheduler.max_waiting == 1000  # a larger bound is kept
    # Auto slots replace the scheduler config after loading: the rule applies again.
    grown = replace(EngineConfig(), scheduler=replace(EngineConfig().scheduler, max_num_seqs=600))
    assert grown.scheduler.max_waiting == 600
