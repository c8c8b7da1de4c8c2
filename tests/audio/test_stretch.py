"""audio/stretch.py: a pitch-preserving time stretch, streamed chunk by chunk with no seams."""

from __future__ import annotations

import numpy as np
import pytest

from chattts_serve.audio.stretch import SpeedPlan, StreamingStretcher, atempo_chain, plan_speed, stretch
from chattts_serve.sampling_params import speed_prompt

from .streaming import SR, fed_in_chunks, sine

FACTORS = [0.25, 0.5, 0.8, 1.25, 1.5, 2.0, 3.0, 4.0]


def _chunked(pcm: np.ndarray, factor: float, sizes: np.ndarray) -> np.ndarray:
    return fed_in_chunks(StreamingStretcher(factor, SR), pcm, sizes)


def _peak_hz(pcm: np.ndarray) -> float:
    """The FFT peak, refined by parabolic interpolation over the Hann-windowed spectrum's log magnitude."""
    spectrum = np.log(np.abs(np.fft.rfft(pcm * np.hanning(len(pcm)))) + 1e-12)
    k = int(np.argmax(spectrum[1:-1])) + 1
    a, b, c = spectrum[k - 1 : k + 2]
    return (k + 0.5 * (a - c) / (a - 2 * b + c)) * SR / len(pcm)


@pytest.mark.parametrize("factor", FACTORS)
def test_chunks_join_to_the_one_shot_output(factor):
    """Many small chunks (1 to 2000 samples) against one call: the one filter graph keeps atempo's window
    and phase across calls, so the joined stream is the one-shot output, sample for sample."""
    rng = np.random.default_rng(0)
    pcm = (rng.standard_normal(3 * SR) * 0.1).astype(np.float32) + sine(330, 3)
    whole = stretch(pcm, factor, SR)
    chunked = _chunked(pcm, factor, rng.integers(1, 2000, size=60))
    assert len(chunked) == len(whole)
    np.testing.assert_allclose(chunked, whole, atol=1e-6)


@pytest.mark.parametrize("factor", FACTORS)
def test_duration_is_the_input_over_the_factor(factor):
    """Exactly ``round(n / factor)`` samples (well within a ms), however the input was cut."""
    pcm = sine(220, 2.5)
    out = _chunked(pcm, factor, np.full(40, 1234))
    assert len(out) == round(len(pcm) / factor)


@pytest.mark.parametrize("factor", FACTORS)
@pytest.mark.parametrize("freq", [150.0, 440.0])
def test_pitch_is_kept(factor, freq):
    """A sine keeps its frequency (within 1 %) while its duration changes: a stretch, not a resample."""
    out = _chunked(sine(freq, 3), factor, np.full(100, 960))  # 40 ms chunks, as a stream gives
    body = out[len(out) // 10 : -len(out) // 10]  # away from the ends
    assert _peak_hz(body) == pytest.approx(freq, rel=0.01)
    assert np.sqrt(np.mean(body**2)) == pytest.approx(0.5 / np.sqrt(2), rel=0.1)  # its level, too


def test_a_sine_through_chunks_has_no_click():
    """20 ms chunks of a 300 Hz sine at 1.5x: no step between neighbouring samples beyond the sine's own
    largest step (with a margin for atempo's overlap-add); a restarted filter would jump at the joins."""
    out = _chunked(sine(300, 2), 1.5, np.full(99, SR // 50))
    body = out[SR // 20 : -SR // 20]
    assert np.abs(np.diff(body)).max() <= 1.2 * 2 * np.pi * 300 / SR * 0.5


def test_atempo_chain_stays_in_range_and_multiplies_to_the_factor():
    for factor in [*FACTORS, 0.3, 3.7, 1 / 3]:
        chain = atempo_chain(factor)
        assert all(0.5 <= f <= 2.0 for f in chain)
        assert np.prod(chain) == pytest.approx(factor)
    assert atempo_chain(4.0) == [2.0, 2.0] and atempo_chain(0.25) == [0.5, 0.5]


def test_plan_speed():
    # the default: today's prompt only (a family with a speed of its own takes ``model`` instead)
    assert plan_speed(1.5) == SpeedPlan(speed_prompt(1.5), 1.0, 1.5)
    assert plan_speed(1.5, "stretch") == SpeedPlan(None, 1.5)
    assert plan_speed(0.5, "both") == SpeedPlan(speed_prompt(0.5), 0.5, 0.5)
    assert plan_speed(1.0, "both") == SpeedPlan(None, 1.0)  # normal leaves the defaults' prompt
    with pytest.raises(ValueError, match="speed_mode"):
        plan_speed(1.5, "fast")
    with pytest.raises(ValueError, match="speed"):
        plan_speed(5.0, "stretch")


def test_edges():
    assert stretch(sine(440, 0.1), 1.0, SR) is not None
    pcm = sine(440, 0.1)
    assert stretch(pcm, 1.0, SR) is pcm
    empty = StreamingStretcher(2.0, SR)
    assert len(empty.process(np.zeros(0, np.float32))) == 0 and len(empty.flush()) == 0
    s = StreamingStretcher(2.0, SR)
    s.process(pcm)
    s.flush()
    assert len(s.flush()) == 0
    with pytest.raises(RuntimeError):
        s.process(pcm)
    with pytest.raises(ValueError):
        StreamingStretcher(8.0, SR)
