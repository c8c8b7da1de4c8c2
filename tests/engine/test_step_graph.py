"""The whole-step graph (``engine.step_graph``) on the CPU: its function, run eagerly, gives every
sequence the tokens and hidden states of the ordinary step, leaves the slots that do not decode alone,
and keeps the one-sync step; the capture-and-check logic runs against stand-in CUDA calls (a graph that
recomputes, one that does nothing, one that corrupts the state). The capture itself needs CUDA
(``scripts/gpu_check.py``)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from chattts_serve.engine.config import EngineConfig, RunnerConfig
from chattts_serve.engine.engine import Engine
from chattts_serve.engine.outputs import SchedulerOutput
from chattts_serve.engine.plan import resolve_plan
from chattts_serve.engine.request import Sequence
from chattts_serve.engine.runner import ModelRunner
from chattts_serve.engine.scheduler import SchedulerConfig
from chattts_serve.engine.step_graph import StepGraph
from chattts_serve.sampling_params import RefineParams, SamplingParams

from .sync_counter import SyncCounter
from .test_cuda_graph import StubCtx
from .test_step_syncs import make_seq as make_seq_from

SLOTS = 24


def make_runner(tiny_ckpt, step_graphs: str, noise: str = "counter", **kw) -> ModelRunner:
    config = EngineConfig(
        scheduler=SchedulerConfig(max_num_seqs=SLOTS, max_model_len=256),
        runner=RunnerConfig(decode="static", sampling_noise=noise, step_graphs=step_graphs, **kw),
    )
    runner = Engine.from_pretrained(tiny_ckpt, device="cpu", config=config).core.stage.runner
    runner.sync_free = True  # the device branches of the sampler, as on CUDA
    return runner


def make_seq(runner: ModelRunner, i: int, slot: int, kind: str = "code") -> Sequence:
    """Sequence i in ``slot``, with its own sampling (``test_step_syncs.make_seq``), code ones with
    a temperature per codebook two times in three."""
    return make_seq_from(runner, i, slot, kind, random.Random(i), four_temps=kind == "code" and bool(i % 3))


def script(runner: ModelRunner) -> list[tuple]:
    """A run whose running set changes as the scheduler changes it: admissions in the same step as
    decode rows, departures, holes in the slots, a text sequence decoding beside code ones for a
    while, a sequence skipped for one step. Each entry: ("step", admitted, decoding) or ("release", seqs)."""
    code = [make_seq(runner, i, slot) for i, slot in enumerate([0, 1, 2, 3, 5, 8, 9, 13])]
    late = [make_seq(runner, 20, 4), make_seq(runner, 21, 19)]
    text = make_seq(runner, 30, 6, kind="text")
    text2 = make_seq(runner, 31, 11, kind="text")
    alive = [s for s in code if s not in (code[2], code[5])]
    steps: list[tuple] = [("step", code, [])]  # admissions alone: nothing for the graph
    steps += [("step", [], code)] * 3
    steps += [("release", [code[2], code[5]])]
    steps += [("step", [], alive)] * 2
    steps += [("step", late, alive), ("step", [], alive + late)]  # admitted beside decode rows
    steps += [("step", [text], alive + late), ("step", [], alive + late + [text])]  # a text row decodes
    steps += [("step", [text2], alive + late + [text])]  # a text admission beside a text decode row
    steps += [("step", [], alive + late + [text, text2]), ("release", [text])]
    steps += [("step", [], alive + late + [text2]), ("release", [text2])]
    steps += [("step", [], alive + late)] * 2
    steps += [("step", [], [s for s in alive + late if s.slot != 5])]  # slot 5 skips a step
    steps += [("step", [], alive + late)] * 2
    return steps


DECODE_STEPS = 17  # entries of ``script`` with decode rows


def drive(runner: ModelRunner, steps) -> list:
    """Run the script; each step's (tokens, hidden rows) by request id (seq ids differ between runs)."""
    torch.manual_seed(0)  # unseeded sequences draw their seeds from the global RNG
    outs = []
    for entry in steps:
        if entry[0] == "release":
            runner.release(entry[1])
            continue
        _, admitted, decoding = entry
        out = runner.execute(SchedulerOutput(prefill=admitted, decode=decoding))
        seqs = admitted + decoding
        tokens = {s.request_id: out.tokens[s.seq_id] for s in seqs}
        hidden = {s.request_id: out.hidden_of(s.seq_id).clone() for s in seqs if s.kind == "code"}
        outs.append((tokens, hidden))
        for seq in seqs:
            seq.tokens.append(out.tokens[seq.seq_id])
    return outs


def test_step_graph_function_gives_the_ordinary_steps_tokens_and_hidden_states(tiny_ckpt):
    plain = make_runner(tiny_ckpt, "off")
    whole = make_runner(tiny_ckpt, "on")
    assert plain.decode_path.name == "static" and isinstance(whole.decode_path, StepGraph)
    want = drive(plain, script(plain))
    got = drive(whole, script(whole))
    assert len(got) == len(want)
    for (tok_g, hid_g), (tok_w, hid_w) in zip(got, want, strict=True):
        assert tok_g == tok_w
        assert hid_g.keys() == hid_w.keys()
        for sid in hid_w:
            assert torch.equal(hid_g[sid], hid_w[sid])
    # Every step with decode rows took the step function (text rows and admissions beside them too).
    assert whole.decode_path.eager_steps == DECODE_STEPS and whole.decode_path.graph_replays == 0


@torch.inference_mode()
def test_a_slot_that_does_not_decode_keeps_its_state_and_its_keys(tiny_ckpt):
    runner = make_runner(tiny_ckpt, "on")
    seqs = [make_seq(runner, i, i) for i in range(4)]
    out = runner.execute(SchedulerOutput(prefill=seqs))
    for s in seqs:
        s.tokens.append(out.tokens[s.seq_id])
    st, cache = runner.slot_state, runner.cache
    idle = seqs[1]  # slot 1, inside the batch bucket of slots 0..3
    saved = {n: getattr(st, n)[idle.slot].clone() for n in ("last", "generated", "history")}
    keys = cache.k[:, idle.slot, :, : cache.max_len - 1].clone()  # all but the scratch position
    runner.execute(SchedulerOutput(decode=[s for s in seqs if s is not idle]))
    assert runner.decode_path.eager_steps == 1
    for n, value in saved.items():
        assert torch.equal(getattr(st, n)[idle.slot], value), n
    assert torch.equal(cache.k[:, idle.slot, :, : cache.max_len - 1], keys)
    assert (st.generated[[0, 2, 3]] == 2).all()


def test_step_graph_step_has_one_sync(tiny_ckpt):
    runner = make_runner(tiny_ckpt, "on")
    seqs = [make_seq(runner, i, i) for i in range(8)]
    out = runner.execute(SchedulerOutput(prefill=seqs))
    for _ in range(3):
        for s in seqs:
            s.tokens.append(out.tokens[s.seq_id])
        counter = SyncCounter(host_buffers=(*runner._readback.hosts, *runner._staging.hosts))
        with counter:
            out = runner.execute(SchedulerOutput(decode=seqs))
        assert counter.total == 1, counter.report()
    assert runner.decode_path.eager_steps == 3


def test_step_graphs_config():
    def path(mode: str, device: str, decode: str = "static", noise: str = "counter", graphs: bool = True) -> str:
        rc = RunnerConfig(decode=decode, sampling_noise=noise, step_graphs=mode, cuda_graphs=graphs)
        return resolve_plan(EngineConfig(runner=rc), device).decode

    assert path("auto", "cuda") == "step-graph"
    assert path("auto", "cuda", graphs=False) == "static"  # graphs off
    assert path("auto", "cpu") == "static"
    assert path("auto", "cuda", noise="generator") == "static"
    assert path("off", "cuda") == "static"
    assert path("on", "cpu", graphs=False) == "step-graph"
    assert resolve_plan(EngineConfig(), "cuda").decode == "step-graph"  # the CUDA defaults
    assert resolve_plan(EngineConfig(), "cpu").decode == "rows"
    with pytest.raises(ValueError, match="needs decode static and sampling_noise counter"):
        path("on", "cpu", decode="rows")
    with pytest.raises(ValueError, match="step_graphs must be one of"):
        RunnerConfig(step_graphs="yes")


@pytest.mark.parametrize("refine", [False, True])
def test_engine_with_step_graphs_on_gives_the_same_audio(tiny_ckpt, refine):
    """The whole engine, static decode with counter noise, step function on against off (with the
    refine pass: text rows decode in the same steps as code rows)."""
    params = SamplingParams(seed=5, max_new_tokens=12, refine_text=refine, refine=RefineParams(max_new_tokens=6))
    results = {}
    for mode in ("off", "on"):
        config = EngineConfig.with_slots(
            4, runner=RunnerConfig(decode="static", sampling_noise="counter", step_graphs=mode)
        )
        eng = Engine.from_pretrained(tiny_ckpt, config=config)
        results[mode] = eng.synthesize(["你好，世界。", "Hello there."], params)
        stats = eng.core.stats()
        assert (stats.step_graph_eager_steps > 0) == (mode == "on")
    for a, b in zip(results["on"], results["off"], strict=True):
        assert np.array_equal(a.codes, b.codes)
        assert np.array_equal(a.audio, b.audio)


# ---------------------------------------------------------------- capture and check, CUDA stood in for


def fake_cuda(monkeypatch, runner: ModelRunner, behaviour: dict[tuple[int, int], str]) -> list:
    """Stand-ins for torch.cuda's stream and graph calls. A "captured" graph replays the step function
    into its outputs ("good"), does nothing ("empty": a capture on the wrong device), or recomputes
    and then corrupts a slot's state ("corrupt"); buckets not in ``behaviour`` are good."""
    sg = runner.decode_path
    capturing: list = []
    graphs: list = []

    class FakeGraph:
        def __init__(self):
            self.replays = 0
            graphs.append(self)

        def bind(self, key, out):
            self.key, self.out = key, out

        def replay(self):
            self.replays += 1
            how = behaviour.get(self.key, "good")
            if how == "empty":
                return
            for mine, fresh in zip(self.out, original(*self.key), strict=True):
                mine.copy_(fresh)
            if how == "corrupt":
                runner.slot_state.last[0].add_(1)

    class FakeGraphCtx(StubCtx):
        def __enter__(self):
            capturing.append(self.a[0])
            return self

        def __exit__(self, *exc):
            capturing.pop()
            return False

    original = sg.step_fn

    def step_fn(bs, ctx, text=False):
        out = original(bs, ctx, text)
        if capturing:
            capturing[-1].bind((bs, ctx, text), out)
        return out

    class FakeStream:
        def __init__(self, device=None):
            self.device = device

        def wait_stream(self, other):
            pass

    monkeypatch.setattr(sg, "step_fn", step_fn)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", StubCtx)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream(device))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", FakeGraphCtx)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    sg.use_graphs = True
    sg.capture_all()  # as at start-up on CUDA
    return graphs


@pytest.mark.parametrize(
    "behaviour, bad_bucket",
    [
        ("good", (16, 256, False)),
        # slots up to 15, code rows only (the script reaches slot 13 first)
        pytest.param("empty", (16, 256, False), marks=pytest.mark.slow),
        ("corrupt", (16, 256, False)),
        pytest.param("corrupt", (24, 256, True), marks=pytest.mark.slow),  # all 24 slots, with text rows
    ],
)
def test_captured_step_graphs_are_checked_and_a_bad_one_never_changes_the_result(
    tiny_ckpt, monkeypatch, caplog, behaviour, bad_bucket
):
    plain = make_runner(tiny_ckpt, "off")
    want = drive(plain, script(plain))
    whole = make_runner(tiny_ckpt, "on")
    graphs = fake_cuda(monkeypatch, whole, {bad_bucket: behaviour})
    with caplog.at_level("WARNING", logger="chattts_serve.engine.step_graph"):
        got = drive(whole, script(whole))
    for (tok_g, hid_g), (tok_w, hid_w) in zip(got, want, strict=True):
        assert tok_g == tok_w
        for sid in hid_w:
            assert torch.equal(hid_g[sid], hid_w[sid])
    sg = whole.decode_path
    buckets = set(sg.graphs) | sg.refused
    assert len(buckets) == len(graphs)  # each bucket captured once, at start-up: none during the steps
    assert buckets == set(sg.buckets()) and len(buckets) == 12  # batch 1, 2, 4, 8, 16, 24 x ctx 256 x text or not
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    if behaviour == "good":
        assert not sg.refused and not warnings
        assert sg.graph_replays == DECODE_STEPS and sg.eager_steps == 0
    else:
        assert sg.refused == {bad_bucket} and bad_bucket not in sg.graphs
        bs, ctx, text = bad_bucket
        assert len(warnings) == 1 and f"batch {bs} ctx {ctx}{' with text rows' if text else ''} on" in warnings[0]
        assert sg.eager_steps >= 1 and sg.graph_replays + sg.eager_steps == DECODE_STEPS


def test_a_bad_step_graph_raises_at_start_up_when_strict(tiny_ckpt, monkeypatch):
    whole = make_runner(tiny_ckpt, "on", strict_cuda_graphs=True)
    with pytest.raises(RuntimeError, match="differs from the eager step"):
        fake_cuda(monkeypatch, whole, {(16, 256, False): "empty"})


@pytest.mark.parametrize("step_graphs, trunk_graphs", [("auto", False), ("on", False), ("off", True)])
def test_the_trunks_own_graphs_are_not_captured_under_step_graphs(step_graphs, trunk_graphs):
    """Every decode step replays a step graph, so the trunk's per-bucket graphs would never replay."""
    rc = RunnerConfig(decode="static", sampling_noise="counter", step_graphs=step_graphs, cuda_graphs=True)
    plan = resolve_plan(EngineConfig(runner=rc), "cuda")
    assert plan.cuda_graphs and plan.trunk_graphs == trunk_graphs


def test_the_step_graph_path_builds_its_static_step_without_graphs(tiny_ckpt, monkeypatch):
    import chattts_serve.engine.decode_static as static_module

    seen = []
    real = static_module.StaticDecoder

    def spy(gpt, cache, use_graphs, *a, **k):
        seen.append(use_graphs)
        return real(gpt, cache, use_graphs, *a, **k)

    monkeypatch.setattr(static_module, "StaticDecoder", spy)
    make_runner(tiny_ckpt, "on", cuda_graphs=True)
    assert seen == [False]
