"""The decode step as a CUDA device runs it, counted on the CPU: at most one host sync per step (the
tokens' copy back) and a number of launches that does not grow with the batch (issue 20, items 5-7).

The runner runs its device path (``sync_free``, the static trunk step, counter noise: what CUDA gets by
default) on the tiny checkpoint, with text and code sequences, seeded and unseeded, each with its own
sampling parameters, driven like the scheduler drives it (``tests/engine/sync_counter.py`` says what
is counted and what it cannot see).
"""

from __future__ import annotations

import random

import pytest
import torch

from chattts_serve.engine.config import EngineConfig, RunnerConfig
from chattts_serve.engine.engine import Engine
from chattts_serve.engine.outputs import SchedulerOutput
from chattts_serve.engine.request import Sequence
from chattts_serve.engine.runner import ModelRunner, SeqInputs, StepSampling
from chattts_serve.engine.scheduler import SchedulerConfig
from chattts_serve.models.chattts.config import AUDIO_EOS

from .sync_counter import SyncCounter

SLOTS = 64
STEPS = 4


def runner_for(tiny_ckpt, noise: str) -> ModelRunner:
    config = EngineConfig(
        scheduler=SchedulerConfig(max_num_seqs=SLOTS, max_model_len=256),
        runner=RunnerConfig(decode="static", sampling_noise=noise),
    )
    runner = Engine.from_pretrained(tiny_ckpt, device="cpu", config=config).core.stage.runner
    runner.sync_free = True  # the CUDA branches of the sampler
    return runner


@pytest.fixture(scope="module", params=["counter", "generator"])
def runner(request, tiny_ckpt) -> ModelRunner:
    return runner_for(tiny_ckpt, request.param)


def make_seq(runner: ModelRunner, i: int, slot: int, kind: str, rng: random.Random, four_temps: bool) -> Sequence:
    """Sequence i in ``slot``, its sampling drawn from ``rng``: a temperature per codebook
    (``four_temps``) or one, top_p, top_k (0 = off included), penalty, seed (or none), prompt and
    min_new_tokens (EOS blocked for a while, or not)."""
    temps = tuple(rng.uniform(0.2, 1) for _ in range(4)) if four_temps else (rng.uniform(0.2, 1.0),)
    sampling = StepSampling(
        temps, rng.uniform(0.5, 1.0), rng.choice([0, 5, 20]), rng.choice([1.0, 1.05, 1.3]), rng.choice([None, i])
    )
    ids = [rng.randrange(runner.heads.vocab["text"]) for _ in range(rng.randint(3, 9))]
    eos = AUDIO_EOS if kind == "code" else runner.text_eos_id
    seq = Sequence(f"r{i}", kind, len(ids), rng.choice([0, 2, 50]), 100, eos, sampling.seed is not None, False)
    seq.payload, seq.slot = SeqInputs(ids, sampling), slot
    return seq


def make_seqs(runner: ModelRunner, n: int, seed: int) -> list[Sequence]:
    """n sequences in slots 0..n-1: text and code mixed (both kinds from 2 on), seeded and not, each
    with its own temperature, top_p, top_k (0 = off included), penalty and min_new_tokens."""
    rng = random.Random(seed)
    seqs = []
    for i in range(n):
        kind = "text" if i % 2 else "code"
        seqs.append(make_seq(runner, i, i, kind, rng, four_temps=kind == "code" and not i % 4))
    return seqs


def drive(runner: ModelRunner, seqs: list[Sequence], steps: int) -> list[tuple[int, SyncCounter]]:
    """Prefill, then ``steps`` decode steps counted; tokens are appended as the scheduler does."""
    counted = []
    out = runner.execute(SchedulerOutput(prefill=seqs))
    for seq in seqs:
        seq.tokens.append(out.tokens[seq.seq_id])
    for _ in range(steps):
        counter = SyncCounter(host_buffers=(runner._readback.host, runner._staging.host))
        with counter:
            out = runner.execute(SchedulerOutput(decode=seqs))
        counted.append((len(seqs), counter))
        for seq in seqs:
            seq.tokens.append(out.tokens[seq.seq_id])
    # The device's bookkeeping agrees with the host's.
    slots = torch.tensor([s.slot for s in seqs])
    assert runner.slot_state.positions(slots).tolist() == [s.cache_len for s in seqs]  # where the next token goes
    runner.release(seqs)
    return counted


@pytest.mark.parametrize("batch", [1, 8, 64])
def test_one_sync_per_decode_step(runner, batch):
    for n, counter in drive(runner, make_seqs(runner, batch, seed=batch), STEPS):
        assert counter.total <= 1, f"batch {n}: {dict(counter.syncs)}"
        assert counter.syncs["d2h"] == 1, "the tokens come back through the registered buffer"


def test_launches_do_not_grow_with_the_batch(tiny_ckpt):
    runner = runner_for(tiny_ckpt, "counter")
    ops = {n: [c.ops for _, c in drive(runner, make_seqs(runner, n, seed=n), STEPS)] for n in (2, 8, 64)}
    # Step 1 builds the step's index tensors; later steps reuse them: the same count at every batch.
    assert ops[2] == ops[8] == ops[64], ops
    assert ops[2][1] < ops[2][0]  # reusing the plan stages and binds nothing


def test_generator_noise_costs_one_draw_per_unseeded_sequence(tiny_ckpt):
    """Why counter noise is the device default: the reference-identical source launches per sequence."""
    runner = runner_for(tiny_ckpt, "generator")
    ops = {n: drive(runner, make_seqs(runner, n, seed=n), 2)[-1][1].ops for n in (8, 64)}
    assert ops[64] > ops[8]


def every_kind_of_sync(buf: torch.Tensor) -> None:
    x = torch.arange(6.0)
    x[0].item()
    bool(x[1] > 0)
    _ = x[[1, 2]]  # list indexing: the list becomes a tensor first
    _ = x[x > 2]
    x[x > 4] = 0.0
    torch.nonzero(x)
    torch.masked_select(x, x > 1)
    torch.tensor([1.0, 2.0]).repeat_interleave(torch.tensor([2, 3]))
    x.tolist()
    buf.copy_(torch.ones(4, dtype=torch.long))
    buf.tolist()  # the host buffer itself: free
    torch.tensor([1.0, 2.0]).repeat_interleave(torch.tensor([2, 3]), output_size=5)  # no sync (2 lifts)


@pytest.mark.parametrize("inference", [False, True])
def test_the_counter_sees_every_kind_of_sync(inference):
    """Also under inference_mode (the runner's), where some composite ops reach the mode whole."""
    buf = torch.zeros(4, dtype=torch.long)
    with SyncCounter(host_buffers=(buf,)) as c, torch.inference_mode(inference):
        every_kind_of_sync(buf)
    assert dict(c.syncs) == {
        "item": 2,
        "from_python": 6,  # the list, the value assigned by a mask, 2 x 2 repeat_interleave inputs
        "bool_index": 2,
        "nonzero": 1,
        "masked_select": 1,
        "repeat_interleave": 1,
        "tolist": 1,
        "d2h": 1,
    }
    assert c.ops > 0


def test_the_old_step_would_fail(tiny_ckpt, monkeypatch):
    """The assertion can fail: a runner that reads one flag back per step is caught."""
    runner = runner_for(tiny_ckpt, "counter")
    real = runner.heads.logits

    def heads_with_a_read(kind, h, idx, n):
        assert int(idx.max()) >= 0  # a host read, as the per-list indexing of the old step did
        return real(kind, h, idx, n)

    monkeypatch.setattr(runner.heads, "logits", heads_with_a_read)
    [(n, counter)] = drive(runner, make_seqs(runner, 8, seed=3), 1)
    assert counter.syncs["item"] == 2 and counter.total == 3, dict(counter.syncs)
