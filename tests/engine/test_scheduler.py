"""engine/scheduler.py driven by hand: made-up ``Sequence``s in, made-up ``RunnerOutput``s back. No model.

A tiny fake runner (``Driver``) plays the part of ``ModelRunner``: every step it answers each prefilled
and decoding sequence with a token (a normal code by default, EOS or anything else when a test says
so), and it keeps the set of sequence states a real runner would hold (created at prefill, dropped
when the sequence shows up in ``SchedulerOutput.finished``).
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from chattts_serve.engine.outputs import RunnerOutput, SchedulerOutput, StepOutput
from chattts_serve.engine.request import Sequence, SequenceStatus
from chattts_serve.engine.scheduler import (
    MAX_EMPTY_RETRIES,
    QueueFullError,
    Scheduler,
    SchedulerConfig,
    SlotPool,
)

AUDIO_EOS = 625
TEXT_EOS = 21133  # any id: the scheduler only compares with the sequence's own eos_id
CODE = (1, 2, 3, 4)


def seq(
    rid: str = "r",
    *,
    kind: str = "code",
    prompt_len: int = 10,
    max_new: int = 100,
    seeded: bool = True,
    retry_empty: bool = True,
    priority: int = 0,
    arrival: float = 0.0,
    rank: int = 0,
) -> Sequence:
    return Sequence(
        request_id=rid,
        kind=kind,
        prompt_len=prompt_len,
        min_new_tokens=0,
        max_new_tokens=max_new,
        eos_id=AUDIO_EOS if kind == "code" else TEXT_EOS,
        seeded=seeded,
        retry_empty=retry_empty,
        priority=priority,
        arrival=arrival,
        rank=rank,
    )


def normal_token(s: Sequence) -> tuple[int, ...]:
    return CODE if s.kind == "code" else (7,)


class Driver:
    """schedule -> fake runner -> update, recording everything."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.states: set[int] = set()  # what a real runner would hold
        self.ever_prefilled: set[int] = set()
        self.schedules: list[SchedulerOutput] = []

    def schedule(self) -> SchedulerOutput:
        out = self.sched.schedule()
        self.schedules.append(out)
        for s in out.finished:
            self.states.discard(s.seq_id)
        for s in out.prefill:
            self.states.add(s.seq_id)
            self.ever_prefilled.add(s.seq_id)
        return out

    def answer(self, out: SchedulerOutput, tokens: dict[int, tuple[int, ...]] | None = None) -> RunnerOutput:
        tokens = tokens or {}
        every = (*out.prefill, *out.decode)
        code = [s for s in every if s.kind == "code"]
        return RunnerOutput(
            {s.seq_id: tokens.get(s.seq_id, normal_token(s)) for s in every},
            [f"h{s.seq_id}" for s in code],  # stands in for the step's hidden-state tensor
            {s.seq_id: row for row, s in enumerate(code)},
        )

    def step(self, tokens: dict[int, tuple[int, ...]] | None = None) -> tuple[SchedulerOutput, list[StepOutput]]:
        out = self.schedule()
        return out, self.sched.update(out, self.answer(out, tokens))

    def run_until_idle(self, limit: int = 10_000) -> None:
        for _ in range(limit):
            if not self.sched.has_unfinished():
                self.schedule()  # the step that reports the last finished ones
                return
            self.step()
        raise AssertionError("scheduler did not drain")


def make(**kw) -> tuple[Scheduler, Driver]:
    s = Scheduler(SchedulerConfig(**kw))
    return s, Driver(s)


def ids(seqs) -> list[int]:
    return [s.seq_id for s in seqs]


# ---------------------------------------------------------------- admission and slots


def test_a_long_request_does_not_starve_later_ones():
    """Request A (6 sentences) arrives first, B (1 sentence) just after; with one slot, B's sentence
    runs right after A's first, not after all of A's."""
    sched, d = make(max_num_seqs=1)
    a = [seq("A", max_new=2, arrival=0.0, rank=i) for i in range(6)]
    b = seq("B", max_new=2, arrival=1.0)
    for s in (*a, b):
        sched.add(s)
    order = []
    for _ in range(100):
        out, _ = d.step()
        order += [s.request_id + str(s.rank) for s in out.prefill]
        if not sched.has_unfinished():
            break
    assert order == ["A0", "B0", "A1", "A2", "A3", "A4", "A5"]


def test_admits_up_to_max_num_seqs():
    sched, d = make(max_num_seqs=3)
    seqs = [seq(f"r{i}", arrival=i) for i in range(5)]
    for s in seqs:
        sched.add(s)
    out, _ = d.step()
    assert ids(out.prefill) == ids(seqs[:3]) and out.decode == []
    assert sched.num_running == 3 and sched.num_waiting == 2 and sched.slots.num_free == 0
    assert all(s.status == SequenceStatus.RUNNING for s in seqs[:3])
    assert all(s.status == SequenceStatus.WAITING and s.slot is None for s in seqs[3:])
    assert sorted(s.slot for s in seqs[:3]) == [0, 1, 2]
    for _ in range(3):  # nobody finishes: nobody else gets in
        out, _ = d.step()
        assert out.prefill == [] and ids(out.decode) == ids(seqs[:3])
    assert sched.num_waiting == 2


def test_slot_reused_after_finish():
    sched, d = make(max_num_seqs=2)
    a, b, c = seq("a", max_new=3, arrival=0), seq("b", max_new=50, arrival=1), seq("c", arrival=2)
    for s in (a, b, c):
        sched.add(s)
    d.step()
    slot_a = a.slot
    assert c.status == SequenceStatus.WAITING
    d.step()
    _, outs = d.step()  # a's third token: length
    assert a.status == SequenceStatus.FINISHED_LENGTH and a.slot is None
    assert [o.finished for o in outs if o.seq is a] == [True]
    assert sched.slots.num_free == 1  # freed in update already
    out, _ = d.step()
    assert ids(out.finished) == [a.seq_id]
    assert ids(out.prefill) == [c.seq_id] and c.slot == slot_a
    assert ids(out.decode) == [b.seq_id]


def test_every_slot_in_use_is_distinct():
    sched, d = make(max_num_seqs=4)
    seqs = [seq(f"r{i}", max_new=1 + i % 5, arrival=i) for i in range(30)]
    for s in seqs:
        sched.add(s)
    while sched.has_unfinished():
        d.step()
        running_slots = [s.slot for s in sched.running]
        assert len(set(running_slots)) == len(running_slots) and None not in running_slots
        assert sched.slots.num_free + sched.num_running == 4
    assert all(s.status == SequenceStatus.FINISHED_LENGTH for s in seqs)
    assert all(s.num_generated == s.max_new_tokens for s in seqs)


def test_slot_pool_hands_out_the_lowest_free_slot():
    pool = SlotPool(6)
    assert [pool.allocate() for _ in range(4)] == [0, 1, 2, 3]
    pool.free(2)  # a hole in the middle ...
    assert pool.allocate() == 2  # ... is filled before the untouched slots 4 and 5
    pool.free(3)
    pool.free(1)  # freed last, but lower: still first
    assert [pool.allocate() for _ in range(pool.num_free)] == [1, 3, 4, 5]
    assert pool.num_free == 0


def test_slot_pool_always_allocates_lowest_first():
    import random

    rng = random.Random(0)
    pool, free = SlotPool(8), set(range(8))
    for _ in range(2000):
        if free and (len(free) == 8 or rng.random() < 0.5):
            slot = pool.allocate()
            assert slot == min(free)
            free.remove(slot)
        else:
            slot = rng.choice(sorted(set(range(8)) - free))
            pool.free(slot)
            free.add(slot)
        assert pool.num_free == len(free)


def test_admission_fills_the_lowest_freed_slot():
    """So the decode step's batch bucket (slots 0..max live slot) follows the live rows: with slots 1 and 3
    freed (1 first), the next sequence gets 1, not the most recently freed 3."""
    sched, d = make(max_num_seqs=4)
    a, b = seq("a", max_new=50, arrival=0), seq("b", max_new=2, arrival=1)
    c, e = seq("c", max_new=50, arrival=2), seq("e", max_new=3, arrival=3)
    for s in (a, b, c, e):
        sched.add(s)
    d.step()
    assert [s.slot for s in (a, b, c, e)] == [0, 1, 2, 3]
    d.step()  # b finishes: slot 1 free
    d.step()  # e finishes: slot 3 free
    assert b.slot is None and e.slot is None and sched.slots.num_free == 2
    f, g = seq("f", arrival=4), seq("g", arrival=5)
    sched.add(f)
    out, _ = d.step()
    assert ids(out.prefill) == [f.seq_id] and f.slot == 1
    sched.add(g)
    out, _ = d.step()
    assert ids(out.prefill) == [g.seq_id] and g.slot == 3


def test_fcfs_by_arrival_priority_first():
    sched, d = make(max_num_seqs=1)
    # Added out of order; arrival decides, then priority trumps arrival; ties by creation order.
    late = seq("late", arrival=5.0, max_new=1)
    early = seq("early", arrival=1.0, max_new=1)
    urgent = seq("urgent", arrival=9.0, priority=2, max_new=1)
    mid = seq("mid", arrival=7.0, priority=1, max_new=1)
    tie1 = seq("tie1", arrival=3.0, max_new=1)
    tie2 = seq("tie2", arrival=3.0, max_new=1)
    for s in (late, early, tie2, urgent, tie1, mid):
        sched.add(s)
    order = []
    while sched.has_unfinished():
        out, _ = d.step()
        order += [s.request_id for s in out.prefill]
    # tie1 was created before tie2 (lower seq_id), so it goes first despite being added later
    assert order == ["urgent", "mid", "early", "tie1", "tie2", "late"]


def test_priority_request_arriving_later_jumps_the_queue():
    sched, d = make(max_num_seqs=1)
    first, second = seq("first", arrival=0, max_new=2), seq("second", arrival=1, max_new=2)
    sched.add(first)
    sched.add(second)
    d.step()
    vip = seq("vip", arrival=2, priority=5, max_new=2)
    sched.add(vip)
    order = []
    while sched.has_unfinished():
        out, _ = d.step()
        order += [s.request_id for s in out.prefill]
    assert order == ["vip", "second"]


# ---------------------------------------------------------------- prefill budget


def test_prefill_budget_admits_one_oversized_prompt_alone():
    sched, d = make(max_num_seqs=8, max_prefill_tokens=100)
    big, small = seq("big", prompt_len=150, arrival=0), seq("small", prompt_len=10, arrival=1)
    sched.add(big)
    sched.add(small)
    out, _ = d.step()
    assert ids(out.prefill) == [big.seq_id]  # over budget on its own, but a slot is free
    out, _ = d.step()
    assert ids(out.prefill) == [small.seq_id] and ids(out.decode) == [big.seq_id]


def test_prefill_budget_limits_further_admissions():
    sched, d = make(max_num_seqs=8, max_prefill_tokens=100)
    lens = [60, 40, 1, 30, 30, 30, 20]
    seqs = [seq(f"r{i}", prompt_len=n, arrival=i) for i, n in enumerate(lens)]
    for s in seqs:
        sched.add(s)
    batches = []
    while sched.num_waiting:
        out, _ = d.step()
        batches.append([s.prompt_len for s in out.prefill])
        assert sum(batches[-1]) <= 100
    # 60 + 40 fills the budget exactly; 1 then waits (strict arrival order, no skipping ahead)
    assert batches == [[60, 40], [1, 30, 30, 30], [20]]


def test_prefill_budget_does_not_skip_ahead():
    sched, d = make(max_num_seqs=8, max_prefill_tokens=50)
    a, b, c = seq("a", prompt_len=30, arrival=0), seq("b", prompt_len=30, arrival=1), seq("c", prompt_len=5, arrival=2)
    for s in (a, b, c):
        sched.add(s)
    out, _ = d.step()
    assert ids(out.prefill) == [a.seq_id]  # c would fit, but b is first in line
    out, _ = d.step()
    assert ids(out.prefill) == [b.seq_id, c.seq_id]


# ---------------------------------------------------------------- lifecycle


def test_prefill_then_decode_next_step():
    sched, d = make(max_num_seqs=4)
    a = seq("a")
    sched.add(a)
    out, outs = d.step()
    assert ids(out.prefill) == [a.seq_id] and out.decode == []
    assert [o.token for o in outs] == [CODE] and a.tokens == [CODE]
    assert d.answer(out).hidden[outs[0].hidden_row] == f"h{a.seq_id}"
    b = seq("b")
    sched.add(b)
    out, _ = d.step()
    assert ids(out.prefill) == [b.seq_id] and ids(out.decode) == [a.seq_id]
    out, _ = d.step()
    assert out.prefill == [] and ids(out.decode) == [a.seq_id, b.seq_id]
    assert a.num_generated == 3 and b.num_generated == 2
    assert a.cache_len == a.prompt_len + 2


@pytest.mark.parametrize("eos_at", [0, 1, 2, 3])
def test_code_eos_in_any_codebook_stops(eos_at):
    sched, d = make()
    a = seq("a", seeded=True)
    sched.add(a)
    d.step()
    d.step()
    token = list(CODE)
    token[eos_at] = AUDIO_EOS
    _, outs = d.step({a.seq_id: tuple(token)})
    [o] = outs
    assert o.finished and o.token is None and not o.restarted
    assert a.status == SequenceStatus.FINISHED_STOPPED and a.status.finish_reason == "stop"
    assert a.tokens == [CODE, CODE]  # the EOS step is not appended
    assert a.slot is None and sched.num_running == 0
    out = d.schedule()
    assert ids(out.finished) == [a.seq_id] and out.is_empty


def test_text_eos_stops():
    sched, d = make()
    t = seq("t", kind="text")
    sched.add(t)
    d.step()
    _, [o] = d.step({t.seq_id: (TEXT_EOS,)})
    assert o.finished and o.token is None and o.hidden_row is None
    assert t.status == SequenceStatus.FINISHED_STOPPED and t.tokens == [(7,)]


def test_text_sequence_ignores_audio_eos_value():
    sched, d = make()
    t = seq("t", kind="text")
    sched.add(t)
    _, [o] = d.step({t.seq_id: (AUDIO_EOS,)})  # a plain text id for a text sequence
    assert not o.finished and t.tokens == [(AUDIO_EOS,)]


def test_max_new_tokens_finishes_with_length():
    sched, d = make()
    a = seq("a", max_new=4)
    sched.add(a)
    for i in range(4):
        _, [o] = d.step()
        assert o.token == CODE and o.finished == (i == 3)
    assert a.status == SequenceStatus.FINISHED_LENGTH and a.status.finish_reason == "length"
    assert a.num_generated == 4 and a.slot is None
    assert ids(d.schedule().finished) == [a.seq_id]


def test_finish_reasons():
    S = SequenceStatus
    # A sequence ends by stop, length or abort; "error" is a request's end (the pipeline's), not a status.
    assert [S(i).finish_reason for i in range(5)] == [None, None, "stop", "length", "aborted"]
    assert [S(i).is_finished for i in range(5)] == [False, False, True, True, True]


def test_mixed_finishes_in_one_step():
    sched, d = make(max_num_seqs=4)
    a, b, c = seq("a", max_new=1), seq("b"), seq("c", kind="text")
    for s in (a, b, c):
        sched.add(s)
    out, outs = d.step({b.seq_id: (0, 0, AUDIO_EOS, 0)})
    assert {o.seq.request_id: o.finished for o in outs} == {"a": True, "b": True, "c": False}
    assert sched.slots.num_free == 3
    out = d.schedule()
    assert set(ids(out.finished)) == {a.seq_id, b.seq_id} and ids(out.decode) == [c.seq_id]


# ---------------------------------------------------------------- empty-output retries


def test_step0_eos_restarts_unseeded_sequence():
    sched, d = make(max_num_seqs=2)
    a = seq("a", seeded=False, retry_empty=True)
    sched.add(a)
    _, [o] = d.step({a.seq_id: (AUDIO_EOS,) * 4})
    assert o.restarted and not o.finished and o.token is None
    assert a.status == SequenceStatus.WAITING and a.slot is None and a.num_retries == 1
    assert sched.num_waiting == 1 and sched.num_running == 0 and sched.slots.num_free == 2
    out, [o] = d.step()  # admitted again: a fresh prefill
    assert ids(out.prefill) == [a.seq_id] and out.finished == []
    assert o.token == CODE and a.tokens == [CODE]
    # EOS after the first kept token is a normal stop
    _, [o] = d.step({a.seq_id: (AUDIO_EOS,) * 4})
    assert o.finished and a.status == SequenceStatus.FINISHED_STOPPED and a.num_retries == 1


def test_step0_eos_retries_at_most_max_empty_retries():
    sched, d = make()
    a = seq("a", seeded=False, retry_empty=True)
    sched.add(a)
    restarts = 0
    for _ in range(MAX_EMPTY_RETRIES + 1):
        _, [o] = d.step({a.seq_id: (AUDIO_EOS,) * 4})
        restarts += o.restarted
        if o.finished:
            break
    assert restarts == MAX_EMPTY_RETRIES and a.num_retries == MAX_EMPTY_RETRIES
    assert o.finished and a.status == SequenceStatus.FINISHED_STOPPED and a.tokens == []
    assert sched.slots.num_free == sched.config.max_num_seqs


@pytest.mark.parametrize(
    "kw",
    [dict(seeded=True, retry_empty=True), dict(seeded=False, retry_empty=False), dict(seeded=True, retry_empty=False)],
)
def test_step0_eos_no_restart(kw):
    sched, d = make()
    a = seq("a", **kw)
    sched.add(a)
    _, [o] = d.step({a.seq_id: (AUDIO_EOS,) * 4})
    assert o.finished and not o.restarted
    assert a.status == SequenceStatus.FINISHED_STOPPED and a.tokens == [] and a.num_retries == 0


def test_restarted_sequence_keeps_its_place_in_line():
    sched, d = make(max_num_seqs=1)
    a = seq("a", seeded=False, arrival=0)
    b = seq("b", arrival=1)
    sched.add(a)
    sched.add(b)
    d.step({a.seq_id: (AUDIO_EOS,) * 4})
    out, _ = d.step()
    assert ids(out.prefill) == [a.seq_id]  # back to the front: it arrived first


# ---------------------------------------------------------------- abort


def test_abort_waiting():
    sched, d = make(max_num_seqs=1)
    a, b, c = seq("a", arrival=0), seq("b", arrival=1), seq("b", arrival=2)
    for s in (a, b, c):
        sched.add(s)
    d.step()
    aborted = sched.abort("b")
    assert set(ids(aborted)) == {b.seq_id, c.seq_id}
    assert all(s.status == SequenceStatus.FINISHED_ABORTED and s.status.finish_reason == "aborted" for s in (b, c))
    assert sched.num_waiting == 0 and sched.num_running == 1
    assert sched.abort("b") == [] and sched.abort("nobody") == []


def test_abort_running_frees_slot_at_next_schedule():
    sched, d = make(max_num_seqs=2)
    a, b, w = seq("a", arrival=0), seq("b", arrival=1), seq("w", arrival=2)
    for s in (a, b, w):
        sched.add(s)
    d.step()
    d.step()
    assert ids(sched.abort("a")) == [a.seq_id]
    assert a.status == SequenceStatus.FINISHED_ABORTED
    assert sched.slots.num_free == 0 and sched.num_running == 2  # still held until the next schedule
    slot = a.slot
    out = d.schedule()
    assert ids(out.finished) == [a.seq_id]
    assert a not in out.decode and ids(out.decode) == [b.seq_id]
    assert ids(out.prefill) == [w.seq_id] and w.slot == slot
    assert a.slot is None and a.num_generated == 2
    outs = sched.update(out, d.answer(out))
    assert {o.seq.request_id for o in outs} == {"b", "w"}
    assert sched.abort("a") == []  # already gone


def test_abort_between_schedule_and_update():
    sched, d = make(max_num_seqs=2)
    a, b = seq("a"), seq("b")
    sched.add(a)
    sched.add(b)
    d.step()
    out = d.schedule()
    result = d.answer(out)  # the runner computed a token for a ...
    sched.abort("a")  # ... but the request was aborted meanwhile
    outs = sched.update(out, result)
    [oa] = [o for o in outs if o.seq is a]
    assert oa.finished and oa.token is None and not oa.restarted
    assert a.tokens == [CODE] and a.status == SequenceStatus.FINISHED_ABORTED
    assert a.slot is None and sched.slots.num_free == 1 and sched.num_running == 1
    out = d.schedule()
    assert ids(out.finished) == [a.seq_id] and ids(out.decode) == [b.seq_id]


def test_abort_during_prefill_step():
    sched, d = make()
    a = seq("a")
    sched.add(a)
    out = d.schedule()
    sched.abort("a")
    [o] = sched.update(out, d.answer(out))
    assert o.finished and a.tokens == [] and a.status == SequenceStatus.FINISHED_ABORTED
    assert ids(d.schedule().finished) == [a.seq_id]
    assert not sched.has_unfinished() and sched.slots.num_free == sched.config.max_num_seqs


def test_failed_request_leaves_through_abort():
    """The engine fails a request (a step or decode error) by aborting it: its waiting sequence leaves the queue
    at once, its running one frees its slot at the next schedule, and both are reported finished exactly once
    (so the runner drops their state)."""
    sched, d = make(max_num_seqs=1)
    a, b = seq("a", arrival=0), seq("b", arrival=1)
    sched.add(a)
    sched.add(b)
    d.step()  # a runs, b waits
    assert ids(sched.abort("b")) == [b.seq_id]
    assert sched.waiting == [] and sched.running == [a]
    assert ids(sched.abort("a")) == [a.seq_id]
    out = d.schedule()
    assert sorted(ids(out.finished)) == sorted(ids([a, b])) and out.is_empty and a.slot is None
    assert all(s.status.finish_reason == "aborted" for s in (a, b))
    assert not sched.has_unfinished() and sched.slots.num_free == 1
    assert d.schedule().finished == []


# ---------------------------------------------------------------- limits and config


def test_queue_bound():
    sched, d = make(max_num_seqs=1, max_waiting=2)
    assert sched.can_accept(2) and not sched.can_accept(3)
    sched.add(seq("a"))
    sched.add(seq("b"))
    assert not sched.can_accept(1) and sched.can_accept(0)
    with pytest.raises(QueueFullError, match="full"):
        sched.add(seq("c"))
    assert sched.num_waiting == 2
    d.step()  # a is admitted: room for one more
    sched.add(seq("c"))
    with pytest.raises(QueueFullError):
        sched.add(seq("d"))
    assert issubclass(QueueFullError, RuntimeError)


def test_too_long_sequence_is_refused_at_add():
    sched, _ = make(max_model_len=100)
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add(seq("a", prompt_len=30, max_new=71))
    assert sched.num_waiting == 0
    sched.add(seq("b", prompt_len=30, max_new=70))  # exactly fits
    assert sched.num_waiting == 1


@pytest.mark.parametrize("name", ["max_num_seqs", "max_model_len", "max_waiting", "max_prefill_tokens"])
@pytest.mark.parametrize("value", [0, -1, 1.5, "4", None])
def test_scheduler_config_validation(name, value):
    with pytest.raises(ValueError, match=name):
        SchedulerConfig(**{name: value})


def test_scheduler_config_defaults_and_frozen():
    c = SchedulerConfig()
    assert c.max_num_seqs >= 1 and c.max_model_len >= 1 and c.max_waiting >= 1 and c.max_prefill_tokens >= 1
    with pytest.raises(AttributeError):
        c.max_num_seqs = 3  # type: ignore[misc]
    assert SchedulerConfig(max_num_seqs=1, max_model_len=1, max_waiting=1, max_prefill_tokens=1).max_num_seqs == 1


# ---------------------------------------------------------------- runner-state bookkeeping


def test_finished_lists_report_every_sequence_that_left():
    """A long random run: every sequence that was prefilled leaves through exactly one ``finished``
    list, after its last step, so a runner that drops state there ends with none."""
    import random

    rng = random.Random(0)
    sched, d = make(max_num_seqs=5, max_prefill_tokens=40)
    all_seqs: list[Sequence] = []
    for step in range(400):
        if step < 300 and rng.random() < 0.4:
            s = seq(
                f"r{len(all_seqs)}",
                kind=rng.choice(["code", "text"]),
                prompt_len=rng.randint(1, 60),
                max_new=rng.randint(1, 20),
                seeded=rng.random() < 0.5,
                retry_empty=rng.random() < 0.5,
                priority=rng.choice([0, 0, 1]),
                arrival=float(step),
            )
            sched.add(s)
            all_seqs.append(s)
        if rng.random() < 0.05 and all_seqs:
            sched.abort(rng.choice(all_seqs).request_id)
        out = d.schedule()
        tokens = {}
        for s in (*out.prefill, *out.decode):
            if rng.random() < 0.1:
                tokens[s.seq_id] = (s.eos_id,) * (4 if s.kind == "code" else 1)
        if rng.random() < 0.05 and sched.running:
            sched.abort(rng.choice(sched.running).request_id)  # between schedule and update
        sched.update(out, d.answer(out, tokens))
    d.run_until_idle()
    assert all(s.status.is_finished for s in all_seqs)
    reported = [s.seq_id for out in d.schedules for s in out.finished]
    assert len(reported) == len(set(reported))
    assert set(reported) <= d.ever_prefilled
    assert d.states == set(), "runner would keep state of sequences that left"
    assert sched.slots.num_free == 5
    statuses = {s.status for s in all_seqs}
    S = SequenceStatus
    assert {S.FINISHED_STOPPED, S.FINISHED_LENGTH, S.FINISHED_ABORTED} <= statuses


def test_restarted_then_aborted_sequence_is_reported_finished():
    sched, d = make()
    a = seq("a", seeded=False, retry_empty=True)
    sched.add(a)
    d.step({a.seq_id: (AUDIO_EOS,) * 4})  # restarted: back to waiting, runner state kept for re-prefill
    assert a.status == SequenceStatus.WAITING and d.states == {a.seq_id}
    sched.abort("a")
    d.run_until_idle()
    assert d.states == set()


# ---------------------------------------------------------------- no torch


def test_scheduler_modules_do_not_import_torch_in_source():
    # outputs.py also holds the user-facing results (numpy audio); torch stays out of all three.
    engine_dir = Path(sys.modules[Scheduler.__module__].__file__).parent
    for name, banned in (
        ("scheduler.py", ("torch", "numpy")),
        ("request.py", ("torch", "numpy")),
        ("outputs.py", ("torch",)),
    ):
        tree = ast.parse((engine_dir / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mods = [node.module or ""] if node.level == 0 else []
            else:
                continue
            assert not any(m.split(".")[0] in banned for m in mods), f"{name} imports {mods}"


def test_scheduler_imports_without_torch_in_subprocess():
    # The package imports the Engine (and so torch) only on first use: the scheduler runs without it.
    code = textwrap.dedent(
        """
        import sys
        import chattts_serve.engine.scheduler as s
        q = s.Scheduler(s.SchedulerConfig(max_num_seqs=1))
        from chattts_serve.engine.request import Sequence
        q.add(Sequence("r", "code", 3, 0, 2, 625, True, True))
        assert len(q.schedule().prefill) == 1
        print("TORCH:", sorted(m for m in sys.modules if m.split(".")[0] == "torch"))
        """
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "TORCH: []" in res.stdout, res.stdout
