"""EngineCore contracts on the tiny checkpoint, driving ``core.step()`` by hand: continuous batching
does not change any request's result, abort frees the slot at once, the waiting queue is bounded,
and a failing request fails alone."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from chattts_serve import Engine, RefineParams, SamplingParams
from chattts_serve.audio.policy import StreamPolicy
from chattts_serve.engine.config import EngineConfig
from chattts_serve.engine.core import EngineCore, EngineStats, RequestOutput
from chattts_serve.engine.scheduler import QueueFullError, SchedulerConfig
from tests.support.engines import chattts_core

TEXT = "今天天气真不错，我们一起去公园散步吧。"
TEXTS = [
    TEXT,
    "你好。",
    "今天天气很好。我们去公园散步吧。明天见。",  # three segments
    "一二三四五六七八九十，十九八七六五四三二一。",
    "我们一起去吃饭吧。",
    "他说：这是一个很长的句子，用来测试不同长度的文本在同一个批次里是否互不影响。",
]


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    return Engine.from_pretrained(tiny_ckpt, device="cpu", config=EngineConfig.with_slots(8))


@pytest.fixture(autouse=True)
def leave_engine_idle(request):
    """Tests share the module's engine: whatever a test leaves running (e.g. after a failure) is
    aborted and drained, so the next test starts from an idle core."""
    yield
    if "engine" in request.fixturenames:
        core = request.getfixturevalue("engine").core
        for rid in list(core.stage.pipeline.requests):
            core.abort(rid)
        for _ in range(5):
            core.step()


def base(**kw) -> SamplingParams:
    p = dict(seed=1, max_new_tokens=40, refine_text=False, refine=RefineParams(max_new_tokens=6))
    p.update(kw)
    return SamplingParams(**p)


class Run:
    """Drives a core: requests arrive at given steps; collects every output per request."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.outputs: dict[str, list[RequestOutput]] = {}
        self.finish_step: dict[str, int] = {}
        self.steps = 0

    def add(self, rid: str, text: str, params: SamplingParams, policy: StreamPolicy | None = None) -> None:
        self.core.add_request(rid, self.core.prepare(text, params), policy)
        self.outputs[rid] = []

    def step(self) -> list[RequestOutput]:
        outs = self.core.step()
        self.steps += 1
        for o in outs:
            assert not self.finished(o.request_id), f"{o.request_id}: output after the final one"
            self.outputs[o.request_id].append(o)
            if o.finished:
                self.finish_step[o.request_id] = self.steps
        return outs

    def finished(self, rid: str) -> bool:
        return bool(self.outputs.get(rid)) and self.outputs[rid][-1].finished

    def final(self, rid: str) -> RequestOutput:
        assert self.finished(rid), rid
        return self.outputs[rid][-1]

    def audio(self, rid: str) -> np.ndarray:
        return np.concatenate([o.audio for o in self.outputs[rid]])

    def drain(self, limit: int = 5000) -> None:
        for _ in range(limit):
            if not self.core.has_unfinished():
                return
            self.step()
        raise AssertionError("engine did not finish")


def assert_idle(core: EngineCore) -> None:
    """After the last request finished: one more (empty) step reports the last sequences that left,
    then the runner holds no sequence state and every slot is free."""
    assert not core.has_unfinished()
    assert core.step() == []
    assert not core.stage.runner.states
    assert core.scheduler.slots.num_free == core.scheduler.config.max_num_seqs
    assert core.scheduler.num_running == core.scheduler.num_waiting == 0


def alone(core: EngineCore, text: str, params: SamplingParams, policy: StreamPolicy | None = None):
    assert not core.has_unfinished()
    run = Run(core)
    run.add("alone", text, params, policy)
    run.drain()
    out = run.final("alone")
    assert out.finish_reason in ("stop", "length"), out.error
    return out, run.audio("alone")


def codes_of(out: RequestOutput) -> list[np.ndarray]:
    return [s.codes for s in out.segments]


def assert_same_result(got: RequestOutput, want: RequestOutput, rid: str = "") -> None:
    assert got.finish_reason == want.finish_reason, rid
    assert [s.text for s in got.segments] == [s.text for s in want.segments], rid
    assert [s.finish_reason for s in got.segments] == [s.finish_reason for s in want.segments], rid
    assert len(got.segments) == len(want.segments), rid
    for a, b in zip(codes_of(got), codes_of(want), strict=True):
        np.testing.assert_array_equal(a, b, err_msg=rid)
    assert got.num_steps == want.num_steps, rid


# ---------------------------------------------------------------- batching does not change results


def mixed_requests(engine) -> list[tuple[str, str, SamplingParams, StreamPolicy | None, int]]:
    """(request id, text, params, policy, arrival step) for 16 requests."""
    spk = [engine.sample_speaker(s) for s in (3, 4)]
    refine4, refine10 = RefineParams(max_new_tokens=4), RefineParams(max_new_tokens=10, seed=3)
    stream = StreamPolicy()
    small = StreamPolicy(first_chunk=4, max_chunk=16, left_context=8, lookahead=4, crossfade=128)
    reqs = [
        # seeds 13, 1, 10, 16 end on EOS after a few dozen steps with the defaults
        ("r00", TEXT, base(seed=13, max_new_tokens=120), None, 0),
        ("r01", TEXT, base(seed=1, max_new_tokens=120), stream, 0),
        ("r02", TEXT, base(seed=10, max_new_tokens=120), None, 0),
        ("r03", TEXT, base(seed=16, max_new_tokens=120), small, 0),
        ("r04", TEXTS[1], base(seed=5, max_new_tokens=20, temperature=(0.1, 0.3, 0.5, 0.9)), None, 0),
        ("r05", TEXTS[2], base(seed=6, max_new_tokens=30, top_p=0.9, top_k=0), None, 0),
        ("r06", TEXTS[3], base(seed=7, max_new_tokens=60, repetition_penalty=1.0, speaker=spk[0]), stream, 2),
        ("r07", TEXTS[4], base(seed=8, max_new_tokens=50, refine_text=True), None, 3),
        ("r08", TEXTS[5], base(seed=9, max_new_tokens=80, temperature=0.7, top_k=5, repetition_penalty=1.3), None, 3),
        ("r09", TEXT, base(seed=11, max_new_tokens=100, refine_text=True, speaker=spk[1]), small, 5),
        ("r10", TEXTS[1], base(seed=12, max_new_tokens=25, min_new_tokens=25, top_p=0.3), None, 8),
        ("r11", TEXTS[2], base(seed=0, max_new_tokens=35, refine_text=True, refine=refine4), None, 8),
        ("r12", TEXT, base(seed=39, max_new_tokens=110, prompt="[speed_2]"), stream, 13),
        ("r13", TEXTS[3], base(seed=14, max_new_tokens=45, temperature=(1.0, 0.2, 0.2, 1.0), top_k=50), None, 21),
        ("r14", TEXTS[4], base(seed=15, max_new_tokens=70, top_p=1.0, speaker=spk[0]), None, 34),
        ("r15", TEXT, base(seed=0, max_new_tokens=90, refine_text=True, refine=refine10), None, 34),
    ]
    assert len(reqs) == 16
    return reqs


def test_batched_results_equal_alone_results(engine):
    core = engine.core
    reqs = mixed_requests(engine)
    run = Run(core)
    max_running = max_waiting = 0
    pending = sorted(reqs, key=lambda r: r[4])
    while pending or core.has_unfinished():
        while pending and pending[0][4] <= run.steps:
            rid, text, params, policy, _ = pending.pop(0)
            run.add(rid, text, params, policy)
        run.step()
        max_running = max(max_running, core.scheduler.num_running)
        max_waiting = max(max_waiting, core.scheduler.num_waiting)
        assert core.scheduler.num_running <= 8
        assert run.steps < 5000
    assert max_running == 8 and max_waiting > 0  # the batch was full and requests had to wait
    assert_idle(core)

    finish_steps = {}
    segment_reasons = []
    for rid, text, params, policy, _ in reqs:
        got = run.final(rid)
        assert got.finish_reason in ("stop", "length"), (rid, got.error)
        want, want_audio = alone(core, text, params, policy)
        assert_same_result(got, want, rid)
        audio = run.audio(rid)
        assert len(audio) == sum(512 * len(c) - 256 for c in codes_of(got) if len(c))
        np.testing.assert_allclose(audio, want_audio, atol=1e-5, err_msg=rid)
        if params.refine_text:
            assert [s.text for s in got.segments] != core.prepare(text, params).segments, rid
        finish_steps[rid] = run.finish_step[rid]
        segment_reasons += [(s.finish_reason, len(s.codes), params.max_new_tokens) for s in got.segments]
    # Sequences ended at different steps, some on EOS well before their limit, some on the limit.
    early = [n for reason, n, cap in segment_reasons if reason == "stop" and n < cap]
    assert len(early) >= 4 and len(set(early)) >= 3, segment_reasons
    assert sum(reason == "length" for reason, _, _ in segment_reasons) >= 3, segment_reasons
    assert len(set(finish_steps.values())) >= 8, finish_steps
    print("\nsegments (reason, steps, max_new_tokens):", segment_reasons)


def test_natural_eos_seeds(engine):
    """The seeds the batching test relies on for early EOS (max_new_tokens 300, default params)."""
    lengths = {}
    for seed in (1, 10, 13, 16):
        out, _ = alone(engine.core, TEXT, base(seed=seed, max_new_tokens=300))
        [seg] = out.segments
        lengths[seed] = (seg.finish_reason, len(seg.codes))
    assert all(reason == "stop" and n < 300 for reason, n in lengths.values()), lengths
    assert len({n for _, n in lengths.values()}) == 4, lengths


def test_streaming_does_not_change_codes(engine):
    p = base(seed=3, max_new_tokens=70)
    one, a1 = alone(engine.core, TEXT, p, StreamPolicy.one_shot())
    st, a2 = alone(engine.core, TEXT, p, StreamPolicy(first_chunk=2, max_chunk=8, lookahead=2, crossfade=64))
    assert_same_result(st, one)
    assert len(a1) == len(a2)


# ---------------------------------------------------------------- abort


def test_abort_frees_slot_and_leaves_others_alone(engine):
    core = chattts_core(engine, EngineConfig(scheduler=SchedulerConfig(max_num_seqs=4)))
    sched = core.scheduler
    reqs = {f"a{i}": (TEXTS[i % 2 * 3], base(seed=20 + i, min_new_tokens=30, max_new_tokens=50)) for i in range(4)}
    late = ("late", TEXTS[4], base(seed=30, max_new_tokens=30))
    run = Run(core)
    for rid, (text, p) in reqs.items():
        run.add(rid, text, p, StreamPolicy())
    run.add(*late)
    for _ in range(6):
        run.step()
    assert sched.num_running == 4 and sched.num_waiting == 1 and sched.slots.num_free == 0
    [victim] = [s for s in sched.running if s.request_id == "a2"]
    slot = victim.slot
    assert victim.num_generated == 6
    assert core.abort("a2") is True
    assert core.abort("a2") is False and core.abort("nobody") is False
    assert sched.slots.num_free == 0  # released at the next step

    outs = {o.request_id: o for o in run.step()}
    final = outs["a2"]
    assert final.finished and final.finish_reason == "aborted" and final.error is None
    assert len(final.audio) == 0 and final.segments is None
    assert victim.seq_id not in core.stage.runner.states
    [newcomer] = [s for s in sched.running if s.request_id == "late"]
    assert newcomer.slot == slot  # the freed slot went to the waiting request in the same step
    assert sched.num_running == 4 and sched.num_waiting == 0
    assert not core.has_request("a2")

    run.drain()
    assert_idle(core)
    for rid, (text, p) in [*reqs.items(), ("late", late[1:])]:
        if rid == "a2":
            continue
        want, _ = alone(core, text, p, StreamPolicy() if rid != "late" else None)
        assert_same_result(run.final(rid), want, rid)


def test_abort_frees_slot_count_on_shared_engine(engine):
    core = engine.core
    run = Run(core)
    for i in range(4):
        run.add(f"b{i}", TEXT, base(seed=40 + i, min_new_tokens=20, max_new_tokens=30))
    for _ in range(3):
        run.step()
    assert core.scheduler.num_running == 4 and core.scheduler.slots.num_free == 4
    core.abort("b1")
    run.step()
    assert core.scheduler.num_running == 3 and core.scheduler.slots.num_free == 5
    assert run.final("b1").finish_reason == "aborted"
    run.drain()
    assert_idle(core)


def test_abort_waiting_and_refining_requests(engine):
    core = chattts_core(engine, EngineConfig(scheduler=SchedulerConfig(max_num_seqs=1)))
    run = Run(core)
    run.add("first", TEXT, base(seed=1, refine_text=True, refine=RefineParams(max_new_tokens=20, min_new_tokens=20)))
    run.add("queued", TEXT, base(seed=2))
    run.step()
    assert core.scheduler.running[0].kind == "text"  # first is refining
    core.abort("queued")
    core.abort("first")
    outs = {o.request_id: o for o in run.step()}
    assert outs["first"].finish_reason == "aborted" and outs["queued"].finish_reason == "aborted"
    assert_idle(core)


# ---------------------------------------------------------------- bounded queue


def test_queue_full(engine):
    core = chattts_core(engine, EngineConfig(scheduler=SchedulerConfig(max_num_seqs=1, max_waiting=2)))
    run = Run(core)
    pa, pb, pc = base(seed=1, max_new_tokens=15), base(seed=2, max_new_tokens=15), base(seed=3, max_new_tokens=15)
    run.add("a", TEXT, pa)
    run.add("b", TEXTS[1], pb)
    with pytest.raises(QueueFullError):
        run.add("c", TEXTS[4], pc)
    assert not core.has_request("c") and core.scheduler.num_waiting == 2
    assert not core.can_accept(1) and core.stats() == EngineStats(0, 2, 1, 0)
    run.step()  # a admitted: one place free in the queue
    assert core.can_accept(1) and not core.can_accept(2) and core.stats() == EngineStats(1, 1, 1, 1)
    with pytest.raises(QueueFullError):  # two segments do not fit in one place; nothing is left behind
        run.add("multi", TEXTS[2], replace(pc, first_sentence_voice=False))
    assert not core.has_request("multi") and core.scheduler.num_waiting == 1
    run.add("c", TEXTS[4], pc)  # the refused id can be used again
    run.drain()
    for rid, text, p in (("a", TEXT, pa), ("b", TEXTS[1], pb), ("c", TEXTS[4], pc)):
        want, _ = alone(core, text, p)
        assert_same_result(run.final(rid), want, rid)
    assert_idle(core)


def test_accepted_refine_request_is_not_failed_by_queue_bound(engine):
    core = chattts_core(engine, EngineConfig(scheduler=SchedulerConfig(max_num_seqs=1, max_waiting=1)))
    run = Run(core)
    run.add("a", "你好。", base(seed=1, max_new_tokens=10, refine_text=True, refine=RefineParams(max_new_tokens=3)))
    run.step()  # a's refine pass is running; the queue is empty again
    run.add("b", "你好。", base(seed=1, max_new_tokens=5))
    run.drain()
    assert run.final("b").finish_reason in ("stop", "length")
    assert run.final("a").finish_reason in ("stop", "length"), run.final("a").error


# ---------------------------------------------------------------- bad ids and failures


def test_duplicate_request_id(engine):
    core = engine.core
    run = Run(core)
    p = base(seed=4, max_new_tokens=12)
    run.add("dup", TEXT, p)
    run.step()
    with pytest.raises(ValueError, match="already"):
        core.add_request("dup", core.prepare(TEXTS[1], p))
    run.drain()
    want, _ = alone(core, TEXT, p)
    assert_same_result(run.final("dup"), want)
    run2 = Run(core)
    run2.add("dup", TEXT, p)  # finished ids may be reused
    run2.drain()
    assert_same_result(run2.final("dup"), want)


def test_failed_step_fails_its_requests_and_engine_keeps_serving(engine, monkeypatch):
    core = engine.core
    run = Run(core)
    p = base(seed=6, min_new_tokens=20, max_new_tokens=25)
    run.add("doomed", TEXT, p, StreamPolicy())
    for _ in range(3):
        run.step()
    real = core.stage.runner.execute
    calls = []

    def boom(sched):
        calls.append(sched)
        if len(calls) == 1:
            raise RuntimeError("device on fire")
        return real(sched)

    monkeypatch.setattr(core.stage.runner, "execute", boom)
    outs = run.step()
    [final] = [o for o in outs if o.request_id == "doomed"]
    assert final.finished and final.finish_reason == "error"
    assert "device on fire" in final.error
    assert not core.has_request("doomed")
    assert core.step() == []  # its sequence leaves the running set; the runner drops its state
    assert_idle(core)

    later = Run(core)
    q = base(seed=7, max_new_tokens=30)
    later.add("later", TEXTS[3], q)
    later.drain()
    monkeypatch.setattr(core.stage.runner, "execute", real)
    want, _ = alone(core, TEXTS[3], q)
    assert_same_result(later.final("later"), want)


def test_failure_in_one_step_spares_requests_added_after(engine, monkeypatch):
    core = engine.core
    run = Run(core)
    run.add("x", TEXT, base(seed=8, min_new_tokens=20, max_new_tokens=20))
    run.step()
    real = core.stage.runner.execute
    state = {"armed": True}

    def once(sched):
        if state["armed"]:
            state["armed"] = False
            raise RuntimeError("transient")
        return real(sched)

    monkeypatch.setattr(core.stage.runner, "execute", once)
    run.step()
    assert run.final("x").finish_reason == "error"
    run.add("y", TEXT, base(seed=8, min_new_tokens=20, max_new_tokens=20))
    run.drain()
    y = run.final("y")
    assert y.finish_reason == "length" and y.segments[0].codes.shape == (20, 4)


def test_a_request_ended_by_its_pipeline_leaves_the_scheduler(engine, monkeypatch):
    """A refined sentence's audio pass that no split fits into a slot (forced here: the tiny model's passes
    always find one) ends the request with an error, and its other sentences' passes leave the scheduler
    with it (they do not run on for nobody)."""
    from chattts_serve.engine import pipeline

    monkeypatch.setattr(pipeline, "fit", lambda *args: None)
    config = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=1, max_model_len=48))
    core = chattts_core(engine, config)
    run = Run(core)
    params = base(
        refine_text=True,
        refine=RefineParams(min_new_tokens=30, max_new_tokens=30),
        min_new_tokens=20,
        max_new_tokens=20,
        first_sentence_voice=False,
    )
    run.add("long", "今天天气很好。我们去公园吧。明天见。", params)
    for _ in range(500):
        run.step()
        if run.finished("long"):
            break
    final = run.final("long")
    assert final.finish_reason == "error" and "does not fit" in final.error
    run.step()  # the step that releases what was running
    assert not core.scheduler.has_unfinished()
    assert_idle(core)


# ---------------------------------------------------------------- audio decode out of memory


def _run_all(core: EngineCore, params: SamplingParams, n: int) -> Run:
    run = Run(core)
    for i in range(n):
        run.add(f"r{i}", TEXTS[i], params, StreamPolicy())
    run.drain()
    return run


def test_audio_decode_oom_retries_smaller_and_every_request_gets_its_audio(engine, monkeypatch):
    """Streams of one length decode their windows as one batch; a device OOM above one window
    (injected) is retried in halves: every request still finishes with its own audio."""
    import torch

    from chattts_serve.audio import decode as decode_module

    core = engine.core
    p = base(seed=8, min_new_tokens=24, max_new_tokens=24)
    want = _run_all(core, p, 4)
    real, sizes = decode_module._decode_batch, []

    def oom_above_one(model, h, *rest):
        sizes.append(h.shape[0])
        if h.shape[0] > 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 6.00 GiB")
        return real(model, h, *rest)

    monkeypatch.setattr(decode_module, "_decode_batch", oom_above_one)
    got = _run_all(core, p, 4)
    assert max(sizes) == 4  # the injected OOM was hit, at the whole batch
    for i in range(4):
        rid = f"r{i}"
        assert got.final(rid).finish_reason == "length", got.final(rid).error
        assert_same_result(got.final(rid), want.final(rid), rid)
        a, b = want.audio(rid), got.audio(rid)
        assert a.shape == b.shape and b.size > 0
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-7, err_msg=rid)  # see tests/audio/test_decode.py
    assert_idle(core)


def test_a_window_that_fails_alone_fails_only_its_request(engine, monkeypatch):
    from chattts_serve.audio import overlap as overlap_module
    from chattts_serve.audio.decode import DecodedBatch

    core = engine.core
    real = overlap_module.decode_on_device

    def doomed_fails(model, windows, *args, **kw):
        out = []
        for batch in real(model, windows, *args, **kw):
            doomed = [i for i in batch.index if windows[i].stream is doomed_stream[0]]
            rest = [(i, n) for i, n in zip(batch.index, batch.samples, strict=True) if i not in doomed]
            if doomed:  # the doomed window fails as if alone; the others keep their rows
                error = RuntimeError("CUDA out of memory (one window)")
                out.append(DecodedBatch(doomed, [0] * len(doomed), error=error))
                keep = [k for k, i in enumerate(batch.index) if i not in doomed]
                wav = batch.wav[keep] if keep else None
                if rest:
                    out.append(DecodedBatch([i for i, _ in rest], [n for _, n in rest], wav=wav))
            else:
                out.append(batch)
        return out

    doomed_stream: list = []
    monkeypatch.setattr(overlap_module, "decode_on_device", doomed_fails)
    run = Run(core)
    p = base(seed=9, min_new_tokens=24, max_new_tokens=24)
    for i in range(3):
        run.add(f"r{i}", TEXTS[i], p, StreamPolicy())
    while not doomed_stream:  # the first audio stream of r0, once it exists
        run.step()
        req = core.stage.pipeline.requests.get("r0")
        streams = [s.stream for s in getattr(req, "segments", []) if getattr(s, "stream", None) is not None]
        doomed_stream += streams[:1]
    run.drain()
    assert run.final("r0").finish_reason == "error" and "one window" in run.final("r0").error
    assert [run.final(r).finish_reason for r in ("r1", "r2")] == ["length", "length"]
    assert_idle(core)


def test_a_sequence_that_leaves_at_its_prefill_is_not_sampled_again(engine):
    """A request whose one token comes from its prefill step leaves before it ever decodes: the next
    step (same decode rows as the prefill step) must not reuse that step's rows, which sampled it."""
    core = chattts_core(engine, EngineConfig(scheduler=SchedulerConfig(max_num_seqs=4)))
    long_p = base(seed=41, min_new_tokens=20, max_new_tokens=20)
    run = Run(core)
    run.add("long", TEXTS[0], long_p)
    for _ in range(3):
        run.step()
    run.add("one", TEXTS[1], base(seed=42, min_new_tokens=1, max_new_tokens=1))
    run.drain()
    assert run.final("one").error is None and run.final("long").error is None
    want, _ = alone(core, TEXTS[0], long_p, None)
    assert_same_result(run.final("long"), want, "long")
    assert_idle(core)
