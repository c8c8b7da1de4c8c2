"""audio/resample.py: a stream resampled chunk by chunk is the one-shot resampling, with no seams."""

from __future__ import annotations

import numpy as np
import pytest

from chattts_serve.audio.resample import StreamingResampler, resample

from .streaming import SR, fed_in_chunks, sine


def _chunked(pcm: np.ndarray, rate: int, sizes: np.ndarray) -> np.ndarray:
    return fed_in_chunks(StreamingResampler(rate, SR), pcm, sizes)


@pytest.mark.parametrize("rate", [8000, 16000, 22050, 44100, 48000])
def test_chunks_join_to_the_one_shot_output(rate):
    """Many small chunks (1 to 2000 samples, the sizes a slow stream or a crossfade tail gives) against one
    call: libswresample keeps its filter history and phase across calls, so nothing is lost, added or
    changed at a join."""
    rng = np.random.default_rng(0)
    pcm = (rng.standard_normal(3 * SR) * 0.2).astype(np.float32) + sine(440, 3)
    whole = resample(pcm, rate, SR)
    chunked = _chunked(pcm, rate, rng.integers(1, 2000, size=100))
    assert abs(len(whole) - len(pcm) * rate / SR) <= 1
    assert len(chunked) == len(whole)
    np.testing.assert_allclose(chunked, whole, atol=1e-6)


@pytest.mark.parametrize("rate", [8000, 48000])
def test_a_sine_through_chunks_has_no_discontinuity(rate):
    """A 300 Hz sine in 20 ms chunks: no step between neighbouring output samples is larger than the sine's own
    largest step (2*pi*f/rate * amplitude), beyond a small filter ripple; a restarted filter would jump."""
    pcm = sine(300, 2)
    out = _chunked(pcm, rate, np.full(99, SR // 50))
    body = out[rate // 10 : -rate // 10]  # away from the filter's start and end
    max_step = 2 * np.pi * 300 / rate * 0.5
    assert np.abs(np.diff(body)).max() <= 1.05 * max_step
    expected = sine(300, 2, rate)[rate // 10 : -rate // 10]
    assert np.abs(body - expected).max() < 0.01  # in phase: libswresample compensates its own delay


def test_same_rate_is_untouched():
    pcm = sine(440, 0.1)
    assert resample(pcm, SR, SR) is pcm


def test_nothing_after_flush():
    resampler = StreamingResampler(8000, SR)
    resampler.process(sine(440, 0.1))
    resampler.flush()
    assert len(resampler.flush()) == 0
    with pytest.raises(RuntimeError):
        resampler.process(sine(440, 0.1))
