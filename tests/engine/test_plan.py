"""The execution plan (``engine.plan``): every "auto" of the config settled once, logged once, and read by
nothing downstream."""

from __future__ import annotations

import ast
import dataclasses
import logging
from pathlib import Path

import pytest
import torch

import chattts_serve
from chattts_serve.engine.config import EngineConfig, RunnerConfig, from_flat
from chattts_serve.engine.engine import Engine
from chattts_serve.engine.plan import DECODE_PATHS, ExecutionPlan, resolve_plan
from chattts_serve.engine.runner import DECODE_PATHS as RUNNER_PATHS


def test_the_defaults_by_device():
    cpu = resolve_plan(EngineConfig(), "cpu")
    assert (cpu.decode, cpu.sampling_noise, cpu.cuda_graphs, cpu.kv_cache_dtype) == (
        "rows",
        "generator",
        False,
        torch.float32,
    )
    assert (cpu.audio_dtype, cpu.audio_overlap, cpu.audio_buckets) == ("fp32", False, False)
    cuda = resolve_plan(EngineConfig(precision="bf16"), "cuda")
    assert (cuda.decode, cuda.decode_mode, cuda.sampling_noise, cuda.cuda_graphs) == (
        "step-graph",
        "static",
        "counter",
        True,
    )
    assert cuda.kv_cache_dtype == torch.bfloat16 and not cuda.trunk_graphs
    assert (cuda.audio_dtype, cuda.audio_overlap, cuda.audio_buckets) == ("bf16", True, True)
    assert (cpu.host_ahead, cpu.audio_graphs, cpu.attention) == (False, False, "sdpa")
    assert cuda.host_ahead and cuda.audio_graphs


def test_host_ahead_audio_graphs_and_the_attention_kernel(monkeypatch):
    """The switches of the host one step ahead and the audio graphs, and the static step's attention
    (``kernels.flex_decode.choose``, its probe stood in): settled here, shown in the plan's line."""
    from chattts_serve.kernels import flex_decode

    assert resolve_plan(EngineConfig(host_ahead="on"), "cpu").host_ahead
    assert not resolve_plan(EngineConfig(host_ahead="off"), "cuda").host_ahead
    assert not resolve_plan(EngineConfig(audio_graphs="on", audio_overlap="off"), "cuda").audio_graphs
    monkeypatch.setattr(flex_decode, "_probe", lambda device, dtype: None)
    flex_decode.choose.cache_clear()
    try:
        cuda = resolve_plan(EngineConfig(precision="bf16"), "cuda")
        assert cuda.attention == "flex"
        assert resolve_plan(EngineConfig(runner=RunnerConfig(decode="rows")), "cuda").attention == "sdpa"
        assert "attention flex, host ahead on" in cuda.describe() and "graphs on)" in cuda.describe()
        monkeypatch.setenv(flex_decode.MODE_ENV, "sdpa")
        flex_decode.choose.cache_clear()
        assert resolve_plan(EngineConfig(precision="bf16"), "cuda").attention == "sdpa"
    finally:
        flex_decode.choose.cache_clear()


def test_a_cpu_overlaps_the_audio_by_default_when_the_engine_has_another_core(monkeypatch):
    """auto on a CPU: the audio worker beside the trunk with 2 or more torch threads (the engine's share of the
    machine), not with 1 (a replica of several on one box); on and off are taken as they are."""
    for threads, want in ((1, False), (2, True), (16, True)):
        monkeypatch.setattr(torch, "get_num_threads", lambda t=threads: t)
        plan = resolve_plan(EngineConfig(), "cpu")
        assert plan.audio_overlap is want
        assert f"overlap {'on' if want else 'off'}" in plan.describe()
        assert resolve_plan(from_flat(audio_overlap="off"), "cpu").audio_overlap is False
        assert resolve_plan(from_flat(audio_overlap="on"), "cpu").audio_overlap is True
    assert not resolve_plan(EngineConfig(), "cpu").audio_buckets  # exact-length windows: bit-exact audio


def test_the_audio_worker_stays_within_the_cores_beside_an_openmp_trunk(monkeypatch):
    """libgomp sleeps at every barrier once its threads outnumber the cores: beside a torch / int4 trunk the
    worker takes the engine's thread count but no more than the cores it leaves (at least 1); beside ONNX
    Runtime's trunk (its own pool) the engine's count."""
    from chattts_serve.cpu import CpuInfo
    from chattts_serve.engine import plan as plan_module

    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    for cores, want in ((2, 1), (3, 1), (8, 2), (1, 1)):
        info = CpuInfo(model="test", arch="x86_64", flags=frozenset(), cores=cores)
        monkeypatch.setattr(plan_module, "probe", lambda info=info: info)
        plan = resolve_plan(EngineConfig(), "cpu")
        assert plan.audio_threads == want and f"overlap on on {want} thread(s)" in plan.describe()
        assert resolve_plan(EngineConfig(precision="int4"), "cpu").audio_threads == want
        assert resolve_plan(EngineConfig(precision="ort-int8"), "cpu").audio_threads == 2


def test_explicit_values_pass_through():
    config = from_flat(
        decode="static",
        sampling_noise="counter",
        step_graphs="off",
        kv_cache_dtype="bf16",
        audio_dtype="tf32",
        audio_overlap="off",
        audio_buckets="on",
        cuda_graphs=False,
    )
    plan = resolve_plan(config, "cuda")
    assert (plan.decode, plan.sampling_noise, plan.cuda_graphs, plan.kv_cache_dtype) == (
        "static",
        "counter",
        False,
        torch.bfloat16,
    )
    assert (plan.audio_dtype, plan.audio_overlap, plan.audio_buckets) == ("tf32", False, True)


def test_ort_precisions_decode_in_onnx_runtime_with_an_fp32_cache():
    plan = resolve_plan(EngineConfig(precision="ort-int8", runner=RunnerConfig(decode="static")), "cpu")
    assert plan.decode == "onnx" and plan.kv_cache_dtype == torch.float32
    with pytest.raises(ValueError, match="the ort-\\* cache is fp32"):
        resolve_plan(EngineConfig(precision="ort-fp32", runner=RunnerConfig(kv_cache_dtype="bf16")), "cpu")


def test_int8_kv_cache_is_a_cpu_torch_mode():
    plan = resolve_plan(EngineConfig(precision="int8-static", runner=RunnerConfig(kv_cache_dtype="int8")), "cpu")
    assert plan.kv_cache_dtype == torch.int8 and plan.decode == "rows"
    assert "kv cache int8 + fp32 scales" in plan.describe()
    with pytest.raises(ValueError, match="int8 runs on the CPU only"):
        resolve_plan(EngineConfig(precision="bf16", runner=RunnerConfig(kv_cache_dtype="int8")), "cuda")
    with pytest.raises(ValueError, match="the ort-\\* cache is fp32"):
        resolve_plan(EngineConfig(precision="ort-int8", runner=RunnerConfig(kv_cache_dtype="int8")), "cpu")


def test_int4_takes_an_int8_cache_where_the_cpp_attention_runs(monkeypatch):
    from chattts_serve.kernels import decode_attention

    monkeypatch.setattr(decode_attention, "cpu_supported", lambda: True)
    assert resolve_plan(EngineConfig(precision="int4"), "cpu").kv_cache_dtype == torch.int8
    bf16 = EngineConfig(precision="int4", runner=RunnerConfig(kv_cache_dtype="bf16"))
    assert resolve_plan(bf16, "cpu").kv_cache_dtype == torch.bfloat16  # asked for: kept
    assert resolve_plan(EngineConfig(precision="int8-static"), "cpu").kv_cache_dtype == torch.float32
    monkeypatch.setattr(decode_attention, "cpu_supported", lambda: False)  # AVX2: torch's SDPA over it is slower
    assert resolve_plan(EngineConfig(precision="int4"), "cpu").kv_cache_dtype == torch.float32


def test_the_plan_is_frozen_and_every_path_has_a_module():
    plan = resolve_plan(EngineConfig(), "cpu")
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.decode = "static"  # type: ignore[misc]
    assert tuple(RUNNER_PATHS) == DECODE_PATHS
    assert {f.name for f in dataclasses.fields(ExecutionPlan)} >= {"decode", "kv_cache_dtype", "sampling_noise"}


def test_the_plan_is_logged_once_and_the_runner_runs_its_path(tiny_ckpt, caplog):
    with caplog.at_level(logging.INFO, logger="chattts_serve"):
        engine = Engine.from_pretrained(tiny_ckpt, "cpu", EngineConfig.with_slots(2))
    lines = [r.getMessage() for r in caplog.records if "execution plan" in r.getMessage()]
    assert lines == [engine.plan.describe()]
    assert lines[0].startswith("execution plan: cpu, precision fp32, decode rows, kv cache fp32, noise generator")
    assert engine.runner.decode_path.name == engine.plan.decode == engine.decode_mode == "rows"
    assert engine.runner.kv_cache_dtype == engine.plan.kv_cache_dtype


PACKAGE = Path(chattts_serve.__file__).parent
SETTLED_ONCE = {PACKAGE / "engine" / "config.py", PACKAGE / "engine" / "plan.py"}
DOWNSTREAM = [
    *sorted(p for p in (PACKAGE / "engine").glob("*.py") if p not in SETTLED_ONCE),
    PACKAGE / "audio" / "decode.py",
    PACKAGE / "audio" / "overlap.py",
    PACKAGE / "models" / "chattts" / "stage.py",
]


@pytest.mark.parametrize("path", DOWNSTREAM, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_nothing_downstream_compares_with_auto(path):
    """``x == "auto"`` (or ``!=``, ``in``) is how an "auto" gets resolved; only the config (validation)
    and the plan may do it."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            values = [node.left, *node.comparators]
            assert not any(isinstance(v, ast.Constant) and v.value == "auto" for v in values), (
                f'{path.name}:{node.lineno} resolves an "auto" itself; read the plan (engine.plan)'
            )


def test_chunked_prefill_is_resolved_once_per_path_and_off_with_one_slot(tiny_ckpt, monkeypatch):
    """Every decode path takes prompt chunks (``PREFILL_CHUNKS``); the load turns the plan's alignment into the
    scheduler's, 0 with one slot (the reference-exact layout: one attention call per prompt, nothing chunked);
    a path that says it cannot take chunks gets engines that prefill whole prompts."""
    from chattts_serve.engine import plan as plan_module

    assert set(plan_module.PREFILL_CHUNKS) == set(DECODE_PATHS)
    configs = (EngineConfig(), EngineConfig(runner=RunnerConfig(decode="static")), EngineConfig(precision="ort-int4"))
    for config in configs:
        plan = resolve_plan(config, "cpu")
        assert plan.prefill_chunk == plan_module.PREFILL_BLOCK and "prefill chunks 64" in plan.describe()
        assert (plan.chunked_prefill(1), plan.chunked_prefill(2)) == (0, plan_module.PREFILL_BLOCK)
    one = Engine.from_pretrained(tiny_ckpt, "cpu", EngineConfig.with_slots(1))
    assert one.core.scheduler.config.prefill_chunk == 0 and one.runner.prefiller.block == 0
    two = Engine.from_pretrained(tiny_ckpt, "cpu", EngineConfig.with_slots(2))
    assert two.core.scheduler.config.prefill_chunk == 64 and two.runner.prefiller.block == 64
    monkeypatch.setitem(plan_module.PREFILL_CHUNKS, "rows", False)
    off = Engine.from_pretrained(tiny_ckpt, "cpu", EngineConfig.with_slots(2))
    assert off.plan.prefill_chunk == 0 and "prefill chunks off" in off.plan.describe()
    assert off.core.scheduler.config.prefill_chunk == 0 and off.runner.prefiller.block == 0
