"""audio.decode: the Decoder + Vocos dtype (``EngineConfig.audio_dtype``) and the CPU probe behind it."""

from __future__ import annotations

import numpy as np
import pytest

from chattts_serve import Engine, SamplingParams
from chattts_serve.audio import decode as decode_module
from chattts_serve.engine.config import EngineConfig, from_flat

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


def test_fp32_is_the_default():
    assert EngineConfig().audio_dtype == "fp32"
    assert from_flat(audio_dtype="bf16").audio_dtype == "bf16"
    with pytest.raises(ValueError, match="audio_dtype must be one of"):
        EngineConfig(audio_dtype="fp16")


@pytest.mark.parametrize(
    ("flags", "expected"),
    [("fpu avx2 fma avx512f avx512_bf16", True), ("fpu avx2 amx_bf16 amx_tile", True), ("fpu avx2 fma", False)],
)
def test_the_cpu_probe_reads_cpuinfo_flags(monkeypatch, tmp_path, flags, expected):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    real_path = decode_module.Path
    monkeypatch.setattr(decode_module, "Path", lambda p: real_path(cpuinfo) if p == "/proc/cpuinfo" else real_path(p))
    assert decode_module.cpu_has_bf16() is expected
