"""audio.decode: the Decoder + Vocos dtype (``EngineConfig.audio_dtype``) and the CPU probe behind it,
bounded batches and out-of-memory retries, and window buckets."""

from __future__ import annotations

import numpy as np
import pytest

from chattts_serve import Engine, SamplingParams
from chattts_serve.audio import decode as decode_module
from chattts_serve.engine.config import EngineConfig, from_flat
from chattts_serve.engine.plan import resolve_plan

FIXED = SamplingParams(seed=3, refine_text=False, min_new_tokens=30, max_new_tokens=30)


def _audio(tiny_ckpt, audio_dtype: str) -> np.ndarray:
    engine = Engine.from_pretrained(tiny_ckpt, config=EngineConfig.with_slots(1, audio_dtype=audio_dtype))
    [result] = engine.synthesize("今天天气真不错。", FIXED)
    return result.audio


def test_bf16_audio_is_close_to_fp32_with_the_same_codes(tiny_ckpt):
    fp32, bf16 = _audio(tiny_ckpt, "fp32"), _audio(tiny_ckpt, "bf16")
    assert fp32.shape == bf16.shape and not np.array_equal(fp32, bf16)  # it really ran in bf16
    snr = 10 * np.log10(np.sum(fp32.astype(np.float64) ** 2) / np.sum((fp32 - bf16).astype(np.float64) ** 2))
    assert snr > 20, snr  # the GPT is untouched; only the waveform moves (~36 dB at full size)


def test_fp32_is_the_default_on_cpu_and_bf16_on_cuda():
    assert EngineConfig().audio_dtype == "auto"
    assert resolve_plan(EngineConfig(), "cpu").audio_dtype == "fp32"
    assert resolve_plan(EngineConfig(), "cuda").audio_dtype == "bf16"
    assert resolve_plan(EngineConfig(audio_dtype="tf32"), "cuda").audio_dtype == "tf32"
    assert from_flat(audio_dtype="bf16").audio_dtype == "bf16"
    with pytest.raises(ValueError, match="audio_dtype must be one of"):
        EngineConfig(audio_dtype="fp16")


def test_tf32_on_a_cpu_is_fp32(tiny_ckpt):
    assert np.array_equal(_audio(tiny_ckpt, "tf32"), _audio(tiny_ckpt, "fp32"))


# --------------------------------------------------------------------------------------------------
# Bounded batches and out-of-memory retries (decode_windows)


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    from chattts_serve.models.chattts import checkpoint

    return checkpoint.load(tiny_ckpt)


def _windows(model, lengths: list[int]):
    import torch

    from chattts_serve.audio.policy import StreamPolicy
    from chattts_serve.audio.stream import AudioStream, Window

    g = torch.Generator().manual_seed(0)
    hidden = model.config.gpt.hidden_size
    out = []
    for n in lengths:
        stream = AudioStream(StreamPolicy.one_shot(), hidden, n, torch.device("cpu"))
        stream.hidden.copy_(torch.randn(n, hidden, generator=g))
        out.append(Window(stream, 0, n, 0, 512 * n - 256, n, True))
    return out


LENGTHS = [6, 6, 9, 6, 6, 6, 9, 6]  # 6 windows of 6 steps, 2 of 9


def _spy(monkeypatch, oom_above: int | None = None, error: type = RuntimeError) -> list[int]:
    """Record every batch size ``_decode_batch`` sees; raise an OOM for batches above ``oom_above``."""
    import torch

    real = decode_module._decode_batch
    sizes: list[int] = []

    def fake(model, h, *rest):
        sizes.append(h.shape[0])
        if oom_above is not None and h.shape[0] > oom_above:
            if error is RuntimeError:
                raise RuntimeError("CUDA out of memory. Tried to allocate 6.00 GiB")
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return real(model, h, *rest)

    monkeypatch.setattr(decode_module, "_decode_batch", fake)
    return sizes


def _same_audio(whole, split) -> None:
    """Every window's audio as in the unsplit call. Not to the bit on a CPU: the ConvNeXt linears run
    on B x T rows and MKL/oneDNN block a matmul by its row count (measured: <= 5e-9 apart)."""
    for a, b in zip(whole, split, strict=True):
        assert isinstance(b, np.ndarray) and a.shape == b.shape
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-7)


def test_activation_estimate_of_the_full_model():
    from chattts_serve.models.chattts.config import ModelConfig

    per_step = decode_module.activation_bytes_per_step(ModelConfig())
    assert 40 * 2**10 <= per_step <= 64 * 2**10
    assert 5e9 < per_step * 256 * 469 < 7e9  # 256 windows of 10 s: the ~5-6 GB the unbounded batch took


def test_batches_are_bounded_by_bytes_with_the_same_audio(model, monkeypatch):
    windows = _windows(model, LENGTHS)
    whole = decode_module.decode_windows(model, windows)
    sizes = _spy(monkeypatch)
    per_step = decode_module.activation_bytes_per_step(model.config)
    bound = per_step * 6 * 2  # two 6-step windows per call
    split = decode_module.decode_windows(model, windows, max_bytes=bound)
    assert sorted(sizes) == [1, 1, 2, 2, 2]  # the 6-step windows in pairs, the 9-step ones alone
    _same_audio(whole, split)


@pytest.mark.parametrize("error", ["torch.cuda.OutOfMemoryError", "RuntimeError"])
def test_out_of_memory_retries_in_halves_and_every_window_gets_its_audio(model, monkeypatch, error):
    import torch

    windows = _windows(model, LENGTHS)
    whole = decode_module.decode_windows(model, windows)
    sizes = _spy(
        monkeypatch, oom_above=2, error=torch.cuda.OutOfMemoryError if error != "RuntimeError" else RuntimeError
    )
    retried = decode_module.decode_windows(model, windows)
    assert sizes[:3] == [6, 3, 1] and max(s for s in sizes if s <= 2) == 2
    _same_audio(whole, retried)


def test_a_window_that_runs_out_of_memory_alone_fails_alone(model, monkeypatch):
    windows = _windows(model, LENGTHS)
    _spy(monkeypatch, oom_above=0)  # even one window is too much
    out = decode_module.decode_windows(model, windows[:3])
    assert all(decode_module.is_oom(r) for r in out)
    sizes = _spy(monkeypatch)
    monkeypatch.setattr(decode_module, "_decode_batch", lambda *a: (_ for _ in ()).throw(ValueError("bad")))
    out = decode_module.decode_windows(model, windows[:2])
    assert [type(r) for r in out] == [ValueError, ValueError] and sizes == []  # not retried: not an OOM


# --------------------------------------------------------------------------------------------------
# Window buckets (CUDA default): fixed shapes, the same audio


def test_window_buckets_are_few_and_waste_at_most_an_eighth():
    sizes = [decode_module.window_bucket(n) for n in range(1, 4097)]
    assert all(b >= n for n, b in zip(range(1, 4097), sizes, strict=True))
    assert sizes == sorted(sizes)  # monotone: a longer window never gets a shorter bucket
    assert all(b - n <= max(7, n // 8) for n, b in zip(range(1, 4097), sizes, strict=True))
    assert len(set(sizes)) <= 56
    assert [decode_module.window_bucket(n) for n in (1, 14, 34, 64, 65, 122, 469)] == [8, 16, 40, 64, 72, 128, 480]
    with pytest.raises(ValueError, match="at least one step"):
        decode_module.window_bucket(0)


def test_plan_batches_groups_by_bucket_within_the_byte_bound():
    steps = [14, 16, 9, 34, 14, 40, 3]
    exact = decode_module.plan_batches(steps, 10, 10**9, buckets=False)
    assert sorted(length for length, _ in exact) == [3, 9, 14, 16, 34, 40]
    bucketed = decode_module.plan_batches(steps, 10, 10**9, buckets=True)
    assert sorted((length, idx) for length, idx in bucketed) == [(8, [6]), (16, [0, 1, 2, 4]), (40, [3, 5])]
    bounded = decode_module.plan_batches(steps, 10, 10 * 16 * 2, buckets=True)  # two 16-step windows a call
    assert [idx for length, idx in bounded if length == 16] == [[0, 1], [2, 4]]
    assert sorted(i for _, idx in bounded for i in idx) == list(range(len(steps)))


def test_bucketed_decode_is_the_unbucketed_decode_trimmed(model, monkeypatch):
    """Windows of 11 lengths, padded to 5 buckets, some starting mid-stream: each row's audio is that
    of its window alone (the padding is masked before every convolution and left out of the iSTFT)."""
    lengths = [1, 3, 6, 7, 9, 14, 16, 17, 33, 40, 70]
    windows = _windows(model, [n + 4 for n in lengths])
    windows = [type(w)(w.stream, 2, 2 + n, 0, 0, n, True) for w, n in zip(windows, lengths, strict=True)]
    exact = decode_module.decode_windows(model, windows)
    sizes = _spy(monkeypatch)
    bucketed = decode_module.decode_windows(model, windows, buckets=True)
    assert len(sizes) == len({decode_module.window_bucket(n) for n in lengths}) < len(lengths)
    for n, a, b in zip(lengths, exact, bucketed, strict=True):
        assert a.shape == b.shape == (512 * n - 256,)
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-7)  # the matmuls see other row counts
