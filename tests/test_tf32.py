"""fp32 means fp32 (``chattts_serve.tf32``): the "fp32" audio decode and the DVAE encode run with every
TF32 switch off (cuDNN convolutions default to TF32), "tf32" turns them on for its scope only, and a
scope on one thread never runs inside another thread's. torch's switches are plain flags, so this runs
on a CPU; the decode's precision is asked for as on a CUDA device."""

from __future__ import annotations

import threading

import pytest
import torch

from chattts_serve import tf32
from chattts_serve.audio import decode

WAIT = 10.0  # seconds: a step that does not come within it has failed (never reached in a passing run)


@pytest.fixture(autouse=True)
def torch_defaults():
    """Each test starts from torch's defaults (cuDNN convolutions in TF32) and leaves them as found."""
    switches = tf32._switches()
    before = [getattr(obj, name) for obj, name, _, _ in switches]
    for obj, name, _, on in switches:
        if obj is not torch.backends.cuda.matmul:  # cuDNN: TF32 by default; cuBLAS: left as torch has it
            setattr(obj, name, on)
    yield
    for (obj, name, _, _), value in zip(switches, before, strict=True):
        setattr(obj, name, value)


def test_torchs_default_is_tf32_convolutions():
    assert tf32.tf32_on()  # why fp32 needs saying: cuDNN convolutions are TF32 unless told otherwise


def test_fp32_audio_on_cuda_runs_with_every_tf32_switch_off():
    before = tf32.state()
    with decode._precision("fp32", "cuda"):
        assert not tf32.tf32_on(), tf32.state()
    assert tf32.state() == before


def test_tf32_audio_turns_tf32_on_for_its_scope_only():
    tf32.strict_fp32()
    assert not tf32.tf32_on()
    with decode._precision("tf32", "cuda"):
        assert all(getattr(obj, name) == on for obj, name, _, on in tf32._switches())
    assert not tf32.tf32_on()


def test_a_cpu_decode_leaves_the_switches_alone():
    before = tf32.state()
    with decode._precision("fp32", "cpu"), decode._precision("tf32", "cpu"):
        assert tf32.state() == before


def test_another_threads_fp32_scope_never_runs_inside_a_tf32_scope():
    tf32.strict_fp32()
    inside, release, seen = threading.Event(), threading.Event(), []

    def tf32_user():
        with tf32.tf32_scope():
            inside.set()
            release.wait(WAIT)

    def fp32_user():
        with tf32.fp32_scope():
            seen.append(tf32.tf32_on())

    a = threading.Thread(target=tf32_user)
    a.start()
    assert inside.wait(WAIT)
    b = threading.Thread(target=fp32_user)
    b.start()
    b.join(0.2)
    assert b.is_alive() and not seen  # waits for the TF32 scope to end instead of running in TF32
    release.set()
    a.join(WAIT), b.join(WAIT)
    assert seen == [False]
    assert not tf32.tf32_on()  # and the baseline is back


def test_the_dvae_encode_runs_without_tf32(tiny_engine, monkeypatch):
    core = tiny_engine.core
    seen = []
    real = core.stage.model.dvae.encode

    def spy(wav):
        seen.append(tf32.tf32_on())
        return real(wav)

    monkeypatch.setattr(core.stage.model.dvae, "encode", spy)
    before = tf32.state()
    core.stage.voice_codes(torch.zeros(24000))
    assert seen == [False] and tf32.state() == before


def test_strict_fp32_turns_every_switch_off():
    tf32.strict_fp32()
    assert all(getattr(obj, name) == strict for obj, name, strict, _ in tf32._switches())
