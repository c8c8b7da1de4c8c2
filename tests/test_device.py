"""Every CUDA call of the engine names the engine's device (``chattts_serve.device``): at run time under
stand-in CUDA calls (``tests/cuda_stub.py``) with the engine on ``cuda:1`` and the thread's current
device left at 0, and statically: no call in the package leaves the device to the thread."""

from __future__ import annotations

import ast
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import chattts_serve
from chattts_serve import device as device_mod
from chattts_serve.audio.overlap import CudaStreams
from chattts_serve.engine.slot_state import TokenReadback
from tests.support.cuda_stub import FakeCuda

CUDA1 = torch.device("cuda", 1)
SRC = Path(chattts_serve.__file__).parent


def test_the_token_wait_and_every_copy_name_the_engines_device(monkeypatch):
    calls = FakeCuda.install(monkeypatch)
    assert calls.current() == torch.device("cuda", 0)  # the calling thread was never bound
    readback = TokenReadback(8, CUDA1)
    tokens = torch.arange(5, dtype=torch.int64)
    np.testing.assert_array_equal(readback.read(tokens), np.arange(5))
    assert calls.named("event.record") == [CUDA1]  # the wait is on the stream the copy was queued on
    assert calls.named("event.synchronize") == [CUDA1]
    assert calls.named("pinned") == [CUDA1, CUDA1]  # its two buffers, pinned while cuda:1 was current

    moved = device_mod.pinned_copy(torch.ones(3), CUDA1)
    assert moved.tolist() == [1.0, 1.0, 1.0]
    streams = CudaStreams(CUDA1)
    side = streams.new()
    streams.record(streams.current())
    assert side.device == CUDA1
    device_mod.bind_thread(CUDA1)
    assert calls.current() == CUDA1
    assert calls.devices() == {CUDA1}, calls.log
    assert not calls.named("current_stream()")


def test_the_engine_loop_thread_binds_the_engines_device(tiny_engine, monkeypatch):
    import chattts_serve.engine.async_engine as async_engine

    seen: list[tuple[torch.device, str]] = []
    monkeypatch.setattr(async_engine, "bind_thread", lambda d: seen.append((d, threading.current_thread().name)))
    eng = async_engine.AsyncEngine(tiny_engine)
    eng.start()
    try:
        for _ in range(200):
            if seen:
                break
            threading.Event().wait(0.01)
    finally:
        eng.shutdown()
    assert seen == [(eng.device, "chattts-engine")]


# ---------------------------------------------------------------------------------- the static check

_NEEDS_DEVICE = {"current_stream", "synchronize", "mem_get_info", "max_memory_allocated", "reset_peak_memory_stats"}
"""torch.cuda functions whose device defaults to the thread's current one."""


def _bare_cuda_calls(tree: ast.AST, path: str) -> list[str]:
    bad = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = ast.unparse(f)
        where = f"{path}:{node.lineno}: {ast.unparse(node)}"
        no_args = not node.args and not node.keywords
        attr = name.removeprefix("torch.cuda.") if name.startswith("torch.cuda.") else None
        if isinstance(f, ast.Attribute) and f.attr == "record" and no_args:
            bad.append(where)  # Event.record(): on the current device's current stream
        elif isinstance(f, ast.Attribute) and f.attr == "pin_memory" and not path.endswith("/device.py"):
            bad.append(where)  # pinned copies go through chattts_serve.device (the engine's device current)
        elif attr in ("set_device", "Stream") and not path.endswith("/device.py"):
            bad.append(where)  # the thread's device is bound, and streams drawn, in one place (device.py)
        elif attr in _NEEDS_DEVICE and no_args:
            bad.append(where)
        elif attr == "graph" and not any(k.arg == "stream" for k in node.keywords):
            bad.append(where)  # captures on torch's process-wide default stream (the current device's)
        if any(k.arg == "pin_memory" for k in node.keywords) and not path.endswith("/device.py"):
            bad.append(where)
    return bad


def test_no_cuda_call_in_the_package_leaves_the_device_to_the_thread():
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        bad += _bare_cuda_calls(ast.parse(path.read_text()), str(path.relative_to(SRC.parent)))
    assert not bad, "CUDA calls without the engine's device:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    "code",
    [
        "torch.cuda.Event().record()",
        "e.record()",
        "torch.cuda.current_stream()",
        "torch.cuda.Stream()",
        "torch.cuda.Stream(device=dev)",  # a pool stream another user may hold: device.new_stream
        "torch.cuda.synchronize()",
        "torch.cuda.graph(g, pool=p)",
        "t.pin_memory()",
        "torch.zeros(3, pin_memory=True)",
    ],
)
def test_the_static_check_sees_a_bare_call(code):
    assert _bare_cuda_calls(ast.parse(code), "x.py")


@pytest.mark.parametrize(
    "code",
    ["torch.cuda.current_stream(dev)", "e.record(s)", "torch.cuda.graph(g, stream=s)", "torch.cuda.synchronize(dev)"],
)
def test_the_static_check_passes_a_named_call(code):
    assert not _bare_cuda_calls(ast.parse(code), "x.py")


def test_a_voice_encode_runs_on_the_engine_loop_thread(tiny_engine, monkeypatch):
    """The DVAE encode behind ``speaker_from_audio`` (voice uploads, a text stream's voice) is device work:
    it runs on the engine loop's thread, between steps, not on a worker thread; its errors reach the caller."""
    import asyncio

    from chattts_serve.engine.async_engine import AsyncEngine
    from chattts_serve.models.chattts.speaker import MIN_VOICE_SAMPLES

    threads: list[str] = []
    real = tiny_engine.core.stage.voice_codes

    def spy(wav):
        threads.append(threading.current_thread().name)
        return real(wav)

    monkeypatch.setattr(tiny_engine.core.stage, "voice_codes", spy)
    eng = AsyncEngine(tiny_engine)
    try:
        wav = np.random.default_rng(0).standard_normal(MIN_VOICE_SAMPLES).astype(np.float32) * 0.1
        speaker = asyncio.run(asyncio.wait_for(eng.speaker_from_audio(wav), 60))
        with pytest.raises(ValueError, match="waveform"):
            asyncio.run(asyncio.wait_for(eng.speaker_from_audio(wav[:10]), 60))
    finally:
        eng.shutdown()
    assert isinstance(speaker, str) and speaker
    assert threads == ["chattts-engine"]


def test_the_gpu_checks_recorder_counts_the_packages_calls_and_flags_a_bare_one(monkeypatch):
    """``scripts/gpu_check.py``'s one-GPU device check (``device_calls``), against stand-in CUDA calls."""
    import importlib.util

    path = SRC.parents[1] / "scripts" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check_script", path)
    gpu_check = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, gpu_check)  # its dataclasses look their module up
    spec.loader.exec_module(gpu_check)
    FakeCuda.install(monkeypatch)
    with gpu_check.device_calls(CUDA1) as (seen, bad):
        TokenReadback(4, CUDA1).read(torch.arange(2))  # named: current_stream(cuda:1), Event.record(its stream)
        device_mod.new_stream(CUDA1)
        exec("torch.cuda.current_stream()", {"__name__": "chattts_serve.stand_in", "torch": torch})
        torch.cuda.current_stream()  # not the package's call: not counted
    assert seen == {"current_stream": 2, "Event.record": 1, "Stream": 1}
    assert bad == ["current_stream from chattts_serve.stand_in: None"]
