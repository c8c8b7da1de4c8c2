"""engine/scheduler.py's "work" admission (batch families: whole utterances, no KV slots), driven by hand:
made-up ``kind="utterance"`` sequences in, a made-up ``RunnerOutput.done`` back. No model, no torch."""

from __future__ import annotations

import random

import pytest

from chattts_serve.engine.outputs import RunnerOutput, SchedulerOutput
from chattts_serve.engine.request import Sequence, SequenceStatus
from chattts_serve.engine.scheduler import Scheduler, SchedulerConfig


def utt(rid: str = "r", work: int = 10, *, priority: int = 0, rank: int = 0, arrival: float = 0.0) -> Sequence:
    return Sequence(
        request_id=rid,
        kind="utterance",
        prompt_len=work,
        min_new_tokens=0,
        max_new_tokens=0,
        eos_id=-1,
        seeded=True,
        retry_empty=False,
        priority=priority,
        rank=rank,
        arrival=arrival,
    )


def make(**kw) -> Scheduler:
    return Scheduler(SchedulerConfig(admission="work", **kw))


def run_step(sched: Scheduler) -> SchedulerOutput:
    """schedule -> the whole batch done -> update."""
    out = sched.schedule()
    sched.update(out, RunnerOutput({}, done={s.seq_id: f"audio of {s.seq_id}" for s in out.prefill}))
    return out


def test_admits_while_the_work_fits_the_budget():
    sched = make(max_batch_work=100, max_num_seqs=16)
    seqs = [utt(f"r{i}", 30, arrival=i) for i in range(5)]
    for s in seqs:
        sched.add(s)
    out = run_step(sched)
    assert out.prefill == seqs[:3] and out.decode == []  # 90 fits, a fourth (120) does not
    assert all(s.status == SequenceStatus.FINISHED_STOPPED for s in seqs[:3])
    assert sched.num_running == 0 and sched.num_waiting == 2
    assert run_step(sched).prefill == seqs[3:]
    assert not sched.has_unfinished()


def test_one_utterance_over_what_is_left_waits_for_the_next_batch_and_none_skips_it():
    """Queue order holds: a large utterance that does not fit after others is not overtaken by a small one."""
    sched = make(max_batch_work=100)
    a, big, small = utt("a", 60, arrival=0), utt("b", 50, arrival=1), utt("c", 10, arrival=2)
    for s in (a, big, small):
        sched.add(s)
    assert run_step(sched).prefill == [a]
    assert run_step(sched).prefill == [big, small]


def test_the_first_utterance_is_always_admitted_and_a_batch_is_at_most_max_num_seqs_rows():
    sched = make(max_batch_work=100, max_num_seqs=2)
    for i in range(5):
        sched.add(utt(f"r{i}", 1, arrival=i))
    assert [len(run_step(sched).prefill) for _ in range(3)] == [2, 2, 1]
    sched.add(utt("whole", 100))
    assert len(run_step(sched).prefill) == 1


def test_an_utterance_larger_than_the_budget_is_refused_at_add():
    sched = make(max_batch_work=50)
    with pytest.raises(ValueError, match="max_batch_work"):
        sched.add(utt("a", 51))
    sched.add(utt("b", 50))  # exactly fits; max_model_len does not apply to utterances
    assert sched.num_waiting == 1


def test_priority_then_sentence_rank_then_arrival():
    sched = make(max_batch_work=10, max_num_seqs=1)
    late_first = utt("a", rank=1, arrival=0)
    early = utt("b", rank=0, arrival=1)
    urgent = utt("c", rank=3, arrival=2, priority=1)
    for s in (late_first, early, urgent):
        sched.add(s)
    assert [run_step(sched).prefill[0] for _ in range(3)] == [urgent, early, late_first]


def test_abort_while_the_batch_runs_finishes_it_aborted_and_it_leaves():
    sched = make()
    a, b = utt("a"), utt("b")
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    sched.abort("a")
    outs = sched.update(out, RunnerOutput({}, done={s.seq_id: "pcm" for s in out.prefill}))
    assert all(o.finished for o in outs)
    assert a.status == SequenceStatus.FINISHED_ABORTED and b.status == SequenceStatus.FINISHED_STOPPED
    assert sched.num_running == 0 and {s.seq_id for s in sched.schedule().finished} == {a.seq_id, b.seq_id}


def test_a_failed_step_leaves_through_abort():
    """The engine fails the step's requests (no update): their sequences leave at the next schedule."""
    sched = make()
    a = utt("a")
    sched.add(a)
    sched.schedule()  # the batch raised: no update
    sched.abort("a")
    out = sched.schedule()
    assert out.finished == [a] and out.is_empty and not sched.has_unfinished()


def test_every_utterance_runs_exactly_once_and_no_batch_passes_the_budget():
    rng = random.Random(0)
    budget = 64
    sched = make(max_batch_work=budget, max_num_seqs=8)
    added, ran = [], []
    for step in range(300):
        for _ in range(rng.randrange(3) if step < 200 else 0):
            s = utt(f"r{len(added)}", rng.randint(1, budget), priority=rng.randrange(2), arrival=step)
            sched.add(s)
            added.append(s)
        out = run_step(sched)
        assert len(out.prefill) <= 8
        assert len(out.prefill) == 1 or sum(s.prompt_len for s in out.prefill) <= budget
        ran += out.prefill
    assert sorted(s.seq_id for s in ran) == sorted(s.seq_id for s in added)
    assert not sched.has_unfinished()


@pytest.mark.parametrize("value", [0, -1, 1.5, None])
def test_config_validation(value):
    with pytest.raises(ValueError, match="max_batch_work"):
        SchedulerConfig(max_batch_work=value)
    with pytest.raises(ValueError, match="admission"):
        SchedulerConfig(admission="tokens")


def test_a_requests_first_utterance_runs_without_its_later_ones():
    """Streaming by sentence: a lone request's first sentence is a batch of its own (its audio leaves after one
    sentence's work); the rest follow together, and other requests' utterances fill the first batch."""
    sched = make(max_batch_work=1000, max_num_seqs=16)
    text = [utt("a", 10, rank=i) for i in range(4)]
    for s in text:
        sched.add(s)
    assert run_step(sched).prefill == text[:1]
    assert run_step(sched).prefill == text[1:]
    b = [utt("b", 10, rank=i, arrival=1) for i in range(2)]
    c = utt("c", 10, arrival=2)
    for s in (*b, c):
        sched.add(s)
    assert run_step(sched).prefill == [b[0], c]  # b's second waits; c's first does not
    assert run_step(sched).prefill == [b[1]]
