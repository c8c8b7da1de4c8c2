"""The host one step ahead of the device (``EngineCore`` with ``host_ahead``, issue 31 item 8): step n+1
is scheduled and queued before step n's tokens are read, proved in order with stand-in CUDA events on
the CPU; the results are those of one step at a time (batch invariance kept: the same audio and codes,
several requests sharing slots, refine passes, a voice step, streaming); a sequence that ended runs one
discarded step, and one at its ``max_new_tokens`` none."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from chattts_serve import Engine, SamplingParams
from chattts_serve.audio.policy import StreamPolicy
from chattts_serve.engine.config import EngineConfig, RunnerConfig
from tests.support.cuda_stub import FakeCuda, FakeEvent
from tests.support.engines import chattts_core

TEXTS = ["今天天气不错。我们去公园。", "你好。", "一二三四五六七八九十。", "我们一起去吃饭吧。"]
RUNNERS = {
    "rows": RunnerConfig(),  # the CPU's defaults: rows decode, generator noise
    "cuda-like": RunnerConfig(decode="static", step_graphs="on", sampling_noise="counter"),  # graphs run eagerly
}


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    return Engine.from_pretrained(tiny_ckpt, device="cpu", config=EngineConfig.with_slots(3))


def run(engine, host_ahead: str, runner: RunnerConfig, slots: int = 3, core_hook=None):
    core = chattts_core(engine, EngineConfig.with_slots(slots, host_ahead=host_ahead, runner=runner))
    assert core.ahead == (host_ahead == "on")
    if core_hook is not None:
        core_hook(core)
    for i, text in enumerate(TEXTS):
        p = SamplingParams(seed=i, refine_text=i == 2, max_new_tokens=60)
        core.add_request(f"r{i}", core.prepare(text, p), StreamPolicy())
    outs: dict[str, list] = {}
    while core.has_unfinished():
        for o in core.step():
            outs.setdefault(o.request_id, []).append(o)
    return core, {
        rid: (np.concatenate([o.audio for o in v]), [s.codes for s in v[-1].segments], v[-1].finish_reason)
        for rid, v in outs.items()
    }


@pytest.mark.parametrize("runner", ["rows", pytest.param("cuda-like", marks=pytest.mark.slow)])
def test_one_step_ahead_gives_what_one_step_at_a_time_gives(engine, runner):
    _, at_once = run(engine, "off", RUNNERS[runner])
    _, ahead = run(engine, "on", RUNNERS[runner])
    assert at_once.keys() == ahead.keys() == {f"r{i}" for i in range(len(TEXTS))}
    reasons = set()
    for rid, (audio, codes, reason) in at_once.items():
        audio2, codes2, reason2 = ahead[rid]
        assert reason == reason2
        reasons.add(reason)
        np.testing.assert_array_equal(audio, audio2)
        assert len(codes) == len(codes2) and all(np.array_equal(a, b) for a, b in zip(codes, codes2, strict=True))
    assert reasons == {"stop", "length"} or len(reasons) == 1  # what the tiny checkpoint gives


class LoggedEvent(FakeEvent):
    """A stand-in token event that logs its record (with the launch it belongs to) and its wait."""

    log: list[tuple[str, int]] = []
    launches = 0

    def record(self, stream=None) -> None:
        super().record(stream)
        self.step = LoggedEvent.launches

    def synchronize(self) -> None:
        super().synchronize()
        LoggedEvent.log.append(("wait", self.step))


@dataclass
class Trace:
    """One run with stand-in token events (``traced_run``)."""

    log: list[tuple[str, int]]
    """Every schedule handed to the stage ("schedule", 1 if it had sequences), every step queued ("launch", n)
    and every token wait ("wait", n), in order."""
    launched: dict[int, int]
    """Steps each sequence was launched in."""
    seqs: dict[int, object]
    """The sequences by id, as they ended."""


def traced_run(engine, monkeypatch, host_ahead: str) -> Trace:
    """Run the requests on the cuda-like runner with stand-in token events, logging and counting launches."""
    calls = FakeCuda.install(monkeypatch)
    LoggedEvent.log, LoggedEvent.launches = [], 0
    trace = Trace(LoggedEvent.log, {}, {})

    def hook(core):
        stage, runner = core.stage, core.stage.runner
        monkeypatch.setattr(runner._readback, "_events", [LoggedEvent(calls=calls), LoggedEvent(calls=calls)])
        real_launch, real_stage_launch = runner.launch, stage.launch

        def launch(sched):
            LoggedEvent.launches += 1
            LoggedEvent.log.append(("launch", LoggedEvent.launches))
            for s in (*sched.prefill, *sched.decode):
                trace.launched[s.seq_id] = trace.launched.get(s.seq_id, 0) + 1
                trace.seqs[s.seq_id] = s
            return real_launch(sched)

        def stage_launch(sched):
            LoggedEvent.log.append(("schedule", int(not sched.is_empty)))
            return real_stage_launch(sched)

        monkeypatch.setattr(runner, "launch", launch)
        monkeypatch.setattr(stage, "launch", stage_launch)

    run(engine, host_ahead, RUNNERS["cuda-like"], core_hook=hook)
    return trace


@pytest.fixture(scope="module")
def traces(engine) -> dict[str, Trace]:
    """One traced run each way, shared by the tests of the order and of the discarded step (a run is seconds)."""
    out = {}
    for host_ahead in ("off", "on"):
        with pytest.MonkeyPatch.context() as monkeypatch:
            out[host_ahead] = traced_run(engine, monkeypatch, host_ahead)
    return out


def overlapped_waits(log: list[tuple[str, int]]) -> tuple[int, int]:
    """(waits for step n made after step n+1 was queued, all waits). Asserts the order: each wait for
    step n comes after the schedule that followed step n, and after step n+1's launch when that
    schedule had sequences (the host never waits on step n before step n+1 is enqueued)."""
    where = {entry: i for i, entry in enumerate(log) if entry[0] in ("launch", "wait")}
    waits = [n for op, n in log if op == "wait"]
    assert waits == sorted(waits) and len(waits) == len({n for op, n in log if op == "launch"})
    overlapped = 0
    for n in waits:
        after = [i for i in range(where[("launch", n)] + 1, len(log)) if log[i][0] == "schedule"]
        assert after and after[0] < where[("wait", n)], f"step {n}'s tokens were read before the next schedule"
        if log[after[0]][1]:  # step n+1 had sequences: it was queued before the wait
            assert where[("launch", n + 1)] < where[("wait", n)]
            overlapped += 1
    return overlapped, len(waits)


def test_the_host_queues_step_n_plus_1_before_it_waits_for_step_n(traces):
    overlapped, waits = overlapped_waits(traces["on"].log)
    # Every wait but those where the model had run out of work (a request's last steps) overlapped.
    assert waits > 50 and overlapped >= waits - 4, (overlapped, waits)


def test_the_order_check_fails_one_step_at_a_time(traces):
    with pytest.raises(AssertionError, match="read before the next schedule"):
        overlapped_waits(traces["off"].log)


def test_a_sequence_that_ended_runs_one_discarded_step(traces):
    """EOS at step n: step n+1 (queued before n was read) runs it too, and its token is dropped; at its
    max_new_tokens the host knows without the tokens, and queues no step after the last. One step at a
    time, an EOS costs its own step only."""
    for host_ahead, after_eos in (("off", 1), ("on", 2)):
        launched, seqs = traces[host_ahead].launched, traces[host_ahead].seqs
        reasons = set()
        for seq_id, seq in seqs.items():
            reason = seq.status.finish_reason
            reasons.add(reason)
            want = len(seq.tokens) + (0 if reason == "length" else after_eos)
            assert launched[seq_id] == want, (host_ahead, seq.kind, reason, launched[seq_id], len(seq.tokens))
        assert reasons == {"stop", "length"}  # both ends are exercised (refine passes end on EOS)
