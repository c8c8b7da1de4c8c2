"""engine/scheduler.py's chunked prefill, driven by hand (no model, no torch): while sequences decode, a prompt
longer than the step's prefill budget goes into its slot in budget-sized chunks over several steps, and the
decoding sequences take a token every one of those steps."""

from __future__ import annotations

import random

import pytest

from chattts_serve.engine.outputs import SchedulerOutput
from chattts_serve.engine.request import SequenceStatus

from .test_scheduler import AUDIO_EOS, CODE, ids, make, seq

BUDGET, ALIGN = 100, 16


def chunks(out: SchedulerOutput) -> list[tuple[int, int, int]]:
    """(seq id, start, end) of every prompt piece of the step."""
    return [(c.seq.seq_id, c.start, c.end) for c in out.chunks()]


def running_stream(sched, d):
    """One sequence decoding (prefilled in a step of its own)."""
    s = seq("stream", prompt_len=10, max_new=1000)
    sched.add(s)
    d.step()
    return s


def test_long_prompt_goes_in_budget_sized_chunks_while_a_stream_decodes():
    sched, d = make(max_num_seqs=4, max_prefill_tokens=BUDGET, prefill_chunk=ALIGN)
    stream = running_stream(sched, d)
    long = seq("long", prompt_len=350)
    sched.add(long)
    steps = []
    while not long.tokens:
        out, _ = d.step()
        steps.append(out)
        assert ids(out.decode) == [stream.seq_id], "the stream decodes every step of the prefill"
        assert sum(c.length for c in out.chunks()) <= BUDGET
    # 100 // 16 * 16 = 96 positions a step, the rest in the last chunk, which samples the first token
    spans = ((0, 96), (96, 192), (192, 288), (288, 350))
    assert [chunks(o) for o in steps] == [[(long.seq_id, a, b)] for a, b in spans]
    assert [ids(o.prefill) for o in steps] == [[], [], [], [long.seq_id]]
    assert steps[-1].prefill_from == {long.seq_id: 288} and long.slot is not None
    assert len(stream.tokens) == 1 + len(steps)
    out, _ = d.step()
    assert ids(out.decode) == [stream.seq_id, long.seq_id] and not out.chunks()


def test_with_nothing_decoding_a_long_prompt_goes_whole():
    """No stream to stall: one call is cheaper than several (and keeps the one-shot prefill)."""
    sched, d = make(max_num_seqs=4, max_prefill_tokens=BUDGET, prefill_chunk=ALIGN)
    long, short = seq("long", prompt_len=350), seq("short", prompt_len=20, arrival=1)
    sched.add(long)
    sched.add(short)
    out, _ = d.step()
    assert chunks(out) == [(long.seq_id, 0, 350)] and ids(out.prefill) == [long.seq_id] and not out.partial
    out, _ = d.step()  # now long decodes: short fits the budget, whole
    assert chunks(out) == [(short.seq_id, 0, 20)] and ids(out.decode) == [long.seq_id]


def test_chunks_off_keeps_whole_prompts():
    """``prefill_chunk`` 0 (one slot, or a decode path without chunks): the step's first prompt goes whole."""
    sched, d = make(max_num_seqs=4, max_prefill_tokens=BUDGET)
    running_stream(sched, d)
    long = seq("long", prompt_len=350)
    sched.add(long)
    out, _ = d.step()
    assert chunks(out) == [(long.seq_id, 0, 350)] and ids(out.prefill) == [long.seq_id]


def test_begun_prompts_go_first_and_the_rest_of_the_budget_admits_more():
    sched, d = make(max_num_seqs=5, max_prefill_tokens=BUDGET, prefill_chunk=ALIGN)
    running_stream(sched, d)
    a = seq("a", prompt_len=150, arrival=1)
    sched.add(a)
    out, _ = d.step()
    assert chunks(out) == [(a.seq_id, 0, 96)]
    b, c = seq("b", prompt_len=30, arrival=2), seq("c", prompt_len=200, arrival=3)
    sched.add(b)
    sched.add(c)
    out, _ = d.step()  # a's last 54, then b whole (30), then 16 left: one block of c
    assert sorted(chunks(out)) == sorted([(a.seq_id, 96, 150), (b.seq_id, 0, 30), (c.seq_id, 0, 16)])
    assert ids(out.prefill) == [a.seq_id, b.seq_id] and [ch.seq.seq_id for ch in out.partial] == [c.seq_id]
    out, _ = d.step()
    assert chunks(out) == [(c.seq_id, 16, 112)]


def test_a_budget_under_one_block_still_moves_the_first_prompt_on():
    sched, d = make(max_num_seqs=4, max_prefill_tokens=10, prefill_chunk=ALIGN)
    running_stream(sched, d)
    long, short = seq("long", prompt_len=40, arrival=1), seq("short", prompt_len=5, arrival=2)
    sched.add(long)
    sched.add(short)
    got = []
    while not long.tokens:
        out, _ = d.step()
        got.append(chunks(out))
    assert got == [[(long.seq_id, 0, 16)], [(long.seq_id, 16, 32)], [(long.seq_id, 32, 40)]]
    assert short.status == SequenceStatus.WAITING  # nothing skips ahead of a prompt in chunks


def test_cancelled_mid_prefill_frees_its_slot():
    sched, d = make(max_num_seqs=2, max_prefill_tokens=BUDGET, prefill_chunk=ALIGN)
    stream = running_stream(sched, d)
    long, nxt = seq("long", prompt_len=350, arrival=1), seq("next", prompt_len=20, arrival=2)
    sched.add(long)
    sched.add(nxt)
    out, _ = d.step()
    assert chunks(out) == [(long.seq_id, 0, 96)] and sched.num_free_slots == 0
    assert sched.abort("long") == [long]
    out, _ = d.step()
    assert ids(out.finished) == [long.seq_id] and long.slot is None
    assert chunks(out) == [(nxt.seq_id, 0, 20)] and ids(out.decode) == [stream.seq_id]
    assert long.status == SequenceStatus.FINISHED_ABORTED and not long.tokens


def test_prompts_in_chunks_hold_their_code_rows():
    """A code sequence takes its audio stream's row at its first token (``code_room``): until then the
    scheduler counts its prompt in chunks against the room itself."""
    sched, d = make(max_num_seqs=4, max_prefill_tokens=BUDGET, prefill_chunk=ALIGN)
    running_stream(sched, d)
    long, other = seq("long", prompt_len=350, arrival=1), seq("other", prompt_len=10, arrival=2)
    sched.add(long)
    sched.add(other)
    out = sched.schedule(code_room=2)  # long begins; other waits only for the budget
    sched.update(out, d.answer(out))
    assert chunks(out) == [(long.seq_id, 0, 96)]
    out = sched.schedule(code_room=1)  # the room's one row is long's
    sched.update(out, d.answer(out))
    assert chunks(out) == [(long.seq_id, 96, 192)] and other.status == SequenceStatus.WAITING


def test_a_restarted_sequence_prefills_from_the_start():
    sched, d = make(max_num_seqs=4, max_prefill_tokens=BUDGET, prefill_chunk=ALIGN)
    running_stream(sched, d)
    long = seq("long", prompt_len=150, seeded=False, retry_empty=True)
    sched.add(long)
    d.step()
    out, outs = d.step({long.seq_id: (AUDIO_EOS,) * 4})  # its first token is EOS: drawn again
    assert ids(out.prefill) == [long.seq_id] and [o.restarted for o in outs if o.seq is long] == [True]
    out, _ = d.step()
    assert chunks(out) == [(long.seq_id, 0, 96)]


@pytest.mark.parametrize("seed", [0, 1])
def test_random_run_keeps_the_budget_and_never_skips_a_decode(seed):
    """A long random run with aborts and EOS: while anything decodes, a step's prefill stays within the budget
    (or one block), every decoding sequence is scheduled every step until it ends, chunks are aligned and
    contiguous, and every sequence leaves with its slot freed."""
    rng = random.Random(seed)
    sched, d = make(max_num_seqs=4, max_prefill_tokens=40, prefill_chunk=8)
    every = []
    done_at: dict[int, int] = {}
    for step in range(600):
        if step < 450 and rng.random() < 0.3:
            s = seq(f"r{len(every)}", prompt_len=rng.randint(1, 150), max_new=rng.randint(1, 30), arrival=step)
            sched.add(s)
            every.append(s)
        if rng.random() < 0.03 and every:
            sched.abort(rng.choice(every).request_id)
        before = {s.seq_id: s.num_prefilled for s in sched.running}
        decoding = [s for s in sched.running if not s.prefilling and not s.status.is_finished]
        out = d.schedule()
        if out.decode:
            assert sum(c.length for c in out.chunks()) <= 40
        assert set(ids(decoding)) <= set(ids(out.decode)), "a decoding sequence was skipped"
        for c in out.chunks():
            assert c.start == before.get(c.seq.seq_id, 0) and c.start % 8 == 0
        tokens = {s.seq_id: (AUDIO_EOS,) * 4 for s in (*out.prefill, *out.decode) if rng.random() < 0.05}
        for o in sched.update(out, d.answer(out, tokens)):
            if o.finished:
                done_at[o.seq.seq_id] = step
    d.run_until_idle()
    assert all(s.status.is_finished for s in every) and sched.num_free_slots == 4
    assert any(o.partial for o in d.schedules), "the run never chunked a prompt"
    assert all(s.tokens == [CODE] * len(s.tokens) for s in every)
