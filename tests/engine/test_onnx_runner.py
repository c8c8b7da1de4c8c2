"""The ort-* precisions through the whole engine (engine/runner.py with models/chattts/onnx_trunk.py): the same
tokens as torch fp32 for ort-fp32, offline and streamed synthesis, batch invariance where promised,
and their rows in ``chattts-serve eval``. Exports are cached in a per-run directory, never the user's."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

pytest.importorskip("onnxruntime", reason="the ort-* precisions need the [onnx] extra")

from chattts_serve import Engine, SamplingParams  # noqa: E402
from chattts_serve.cli import main  # noqa: E402
from chattts_serve.engine.async_engine import AsyncEngine  # noqa: E402
from chattts_serve.engine.config import EngineConfig, RunnerConfig  # noqa: E402
from chattts_serve.sampling_params import RefineParams  # noqa: E402

PARAMS = SamplingParams(seed=5, max_new_tokens=24, refine_text=False)
TEXTS = ["你好，世界。", "Hello there, my friend.", "Good morning."]


@pytest.fixture(scope="module")
def onnx_cache(onnx_cache_dir):
    return onnx_cache_dir


def _config(precision: str, onnx_cache: str, slots: int = 4, crossover: int = 0) -> EngineConfig:
    runner = RunnerConfig(onnx_cache_dir=onnx_cache, ort_auto_crossover=crossover)
    return EngineConfig.with_slots(slots, precision=precision, runner=runner)


@pytest.fixture(scope="module", params=["ort-fp32", "ort-int8", "ort-int4", "ort-auto"])
def engine(request, tiny_ckpt, onnx_cache):
    return Engine.from_pretrained(tiny_ckpt, config=_config(request.param, onnx_cache))


def test_trunk_runs_in_onnx_runtime(engine):
    assert engine.decode_mode == "onnx" and engine.layout.trunk is not None
    # The torch trunk gave its weights up: a stray call into it cannot run on them.
    assert all(p.is_meta for p in engine.model.gpt.parameters())


def test_ort_fp32_tokens_equal_torch_fp32(tiny_ckpt, onnx_cache):
    """Hidden states differ from torch's in the last bits (other kernels, ~3e-7 relative); on the tiny
    checkpoint that never flips a sampled code, so seeded requests give the same tokens, batched or not."""
    ort = Engine.from_pretrained(tiny_ckpt, config=_config("ort-fp32", onnx_cache))
    ref = Engine.from_pretrained(tiny_ckpt, config=EngineConfig.with_slots(4))
    for a, b in zip(ort.synthesize(TEXTS, PARAMS), ref.synthesize(TEXTS, PARAMS), strict=True):
        np.testing.assert_array_equal(a.codes, b.codes)
        np.testing.assert_allclose(a.audio, b.audio, atol=1e-3)
    # The refine pass (text head) through ORT too.
    refine = SamplingParams(seed=3, max_new_tokens=16, refine=RefineParams(seed=4, max_new_tokens=12))
    [a], [b] = ort.synthesize(TEXTS[:1], refine), ref.synthesize(TEXTS[:1], refine)
    assert [s.text for s in a.segments] == [s.text for s in b.segments]
    np.testing.assert_array_equal(a.codes, b.codes)


def test_synthesize_repeats(engine):
    a = engine.synthesize(TEXTS, PARAMS)
    b = engine.synthesize(TEXTS, PARAMS)
    for x, y in zip(a, b, strict=True):
        assert x.codes.shape[0] > 0 and np.isfinite(x.audio).all()
        np.testing.assert_array_equal(x.codes, y.codes)


def test_batch_invariance_where_promised(engine):
    if engine.precision.name == "ort-int8":  # one activation scale per call (tests/models/chattts/test_onnx.py)
        pytest.skip("ort-int8 does not promise batch invariance")
    if engine.precision.name == "ort-auto":  # the kernel follows the rows in a call (models/chattts/onnx_auto.py)
        pytest.skip("ort-auto does not promise batch invariance")
    batched = engine.synthesize(TEXTS, PARAMS)[1]
    alone = engine.synthesize(TEXTS[1:2], PARAMS)[0]
    np.testing.assert_array_equal(batched.codes, alone.codes)


def test_ort_auto_is_ort_int8_or_ort_int4_at_the_extremes(tiny_ckpt, onnx_cache):
    """A crossover of 1 row sends every call to the int8 session, one past any call's width every call
    to the 4-bit one: the engine then gives exactly those modes' codes. In between both run, over one
    cache, and a sequence still finishes with valid, repeatable codes."""
    engines = {
        name: Engine.from_pretrained(tiny_ckpt, config=_config(precision, onnx_cache, crossover=crossover))
        for name, precision, crossover in (
            ("int8", "ort-int8", 0),
            ("int4", "ort-int4", 0),
            ("auto-int8", "ort-auto", 1),
            ("auto-int4", "ort-auto", 10**6),
            ("auto-mixed", "ort-auto", 2),
        )
    }
    out = {name: e.synthesize(TEXTS, PARAMS) for name, e in engines.items()}
    for auto, plain in (("auto-int8", "int8"), ("auto-int4", "int4")):
        for a, b in zip(out[auto], out[plain], strict=True):
            np.testing.assert_array_equal(a.codes, b.codes)
    assert engines["auto-int8"].layout.trunk.calls["small"] == 0
    assert engines["auto-int4"].layout.trunk.calls["large"] == 0
    # Crossover 2: the 3-row batch decodes in int8; one text alone has its prompt in int8 and its
    # codes in 4-bit, read on from the cache the int8 prompt wrote.
    mixed = engines["auto-mixed"]
    calls = mixed.layout.trunk.calls
    assert calls["small"] == 0 and calls["large"] > 0
    alone = mixed.synthesize(TEXTS[:1], PARAMS) + mixed.synthesize(TEXTS[:1], PARAMS)
    assert calls["small"] > 0
    for a in alone:
        assert 0 < a.codes.shape[0] <= PARAMS.max_new_tokens and np.isfinite(a.audio).all()
        assert a.codes.min() >= 0 and a.codes.max() < 626
    np.testing.assert_array_equal(alone[0].codes, alone[1].codes)


def test_streaming_with_ort_int8(tiny_ckpt, onnx_cache):
    engine = AsyncEngine.from_pretrained(tiny_ckpt, config=_config("ort-int8", onnx_cache, slots=2))
    params = SamplingParams(seed=9, min_new_tokens=40, max_new_tokens=40, refine_text=False)

    async def both():
        return await asyncio.gather(*(collect(engine, t, params) for t in TEXTS[:2]))

    async def collect(e, text, p):
        return [c async for c in e.stream(text, p)]

    try:
        streams = asyncio.run(asyncio.wait_for(both(), 120))
    finally:
        engine.shutdown()
    for chunks in streams:
        assert len(chunks) > 1 and chunks[-1].finished and chunks[-1].finish_reason == "length"
        audio = np.concatenate([c.audio for c in chunks])
        assert len(audio) == 512 * 40 - 256 and np.isfinite(audio).all()


def test_eval_reports_the_ort_modes(tiny_ckpt, onnx_cache, capsys):
    argv = ["eval", "--model", str(tiny_ckpt), "--threads", "1", "--steps", "12", "--num-texts", "2"]
    assert main([*argv, "--modes", "ort-fp32,ort-int8", "--onnx-cache-dir", onnx_cache]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    exact, int8 = r["modes"]
    assert exact["precision"] == "ort-fp32" and exact["tf_top1_agreement"] == 1.0
    assert abs(exact["tf_kl_nats"]) < 1e-5 and exact["free_run_code_agreement"] == 1.0
    assert int8["precision"] == "ort-int8" and 0.5 < int8["tf_top1_agreement"] <= 1 and int8["tf_kl_nats"] > 0
    assert "| ort-int8 |" in r["markdown"]


def test_eval_reports_ort_auto_at_one_row(tiny_ckpt, onnx_cache, capsys):
    """eval runs one sequence at a time: prompts (wider than the crossover) in int8, code steps in 4-bit."""
    argv = ["eval", "--model", str(tiny_ckpt), "--threads", "1", "--steps", "12", "--num-texts", "1"]
    assert main([*argv, "--modes", "ort-auto", "--onnx-cache-dir", onnx_cache, "--ort-auto-crossover", "4"]) == 0
    [row] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["modes"]
    assert row["precision"] == "ort-auto" and 0.5 < row["tf_top1_agreement"] <= 1 and row["tf_kl_nats"] > 0
    # Per pass: one prompt call, 11 single-row steps (teacher-forced) and about as many free-run steps.
    assert 0.8 < row["ort_auto_int4_share"] < 1


def test_profile_splits_the_ort_step_by_op(tiny_ckpt, onnx_cache, capsys):
    argv = ["profile", "--model", str(tiny_ckpt), "--threads", "1", "--steps", "12", "--streams", "2"]
    assert main([*argv, "--format", "pcm", "--precision", "ort-int8", "--onnx-cache-dir", onnx_cache, "--ops"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ops = r["ort_ops"]
    # The second pass runs the same requests: as many decode steps, one prefill call for both prompts.
    assert ops["decode_steps"] == r["stages"]["decode"]["calls"] and ops["prefill_runs"] == 1
    assert {"DynamicQuantizeMatMul", "GroupQueryAttention"} <= set(ops["decode_op_ms_per_step"])
    classes = ops["decode_classes"]
    assert sum(c["ms"] for c in classes.values()) == pytest.approx(ops["decode_kernel_ms_per_step"], abs=3e-3)
    assert classes["matmul"]["ms"] >= ops["decode_op_ms_per_step"]["DynamicQuantizeMatMul"] > 0
    assert classes["matmul"]["floor_ms"] == pytest.approx(r["weight_read_floor_ms"], abs=1e-3)
    assert classes["attention"]["floor_ms"] > 0 and classes["other"]["floor_ms"] is None
    assert ops["decode_kernel_ms_per_step"] <= ops["decode_run_ms_per_step"] + 0.05
    # ort-auto: both sessions' profiles as one (2 rows decode in 4-bit, the prompts in int8).
    auto = ["--precision", "ort-auto", "--ort-auto-crossover", "4", "--onnx-cache-dir", onnx_cache]
    assert main([*argv, "--format", "pcm", *auto, "--ops"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ops = r["ort_ops"]
    assert ops["decode_steps"] == r["stages"]["decode"]["calls"] and ops["prefill_runs"] == 1
    assert "MatMulNBits" in ops["decode_op_ms_per_step"] and "DynamicQuantizeMatMul" not in ops["decode_op_ms_per_step"]
    # Splitting ORT's step needs ORT's step.
    assert main([*argv, "--ops"]) == 2
    assert "needs an ort-* precision" in capsys.readouterr().err


def test_ort_int4_b128_runs_block_128_and_keeps_batch_invariance(tiny_ckpt, onnx_cache):
    """The 4-bit export at block 128 (issue 33: faster at 1-8 rows): its MatMulNBits nodes carry block
    128, and a text's codes are the same alone and batched (MLAS computes each row alone)."""
    import onnx

    engine = Engine.from_pretrained(tiny_ckpt, config=_config("ort-int4-b128", onnx_cache))
    trunk = engine.layout.trunk
    graph = onnx.load(str(trunk.directory / "model.onnx"), load_external_data=False).graph
    blocks = {a.i for n in graph.node if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "block_size"}
    assert blocks == {128}
    batched = engine.synthesize(TEXTS, PARAMS)
    alone = engine.synthesize(TEXTS[1:2], PARAMS)[0]
    np.testing.assert_array_equal(batched[1].codes, alone.codes)
