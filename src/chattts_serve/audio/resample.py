"""Sample-rate conversion of one audio stream, chunk by chunk (PyAV's ``AudioResampler``: libswresample).

A model makes audio at its own rate (ChatTTS 24 kHz); telephony wants 8 kHz, some players 16, 44.1 or 48 kHz.
A response's audio arrives in chunks, and resampling each chunk on its own would restart the filter at every
join (a click, and a few samples lost or added each time). One ``StreamingResampler`` per response keeps libswresample's
filter history and fractional phase across chunks, so the joined output is the one-shot output: the same
samples, bit for bit (tests/audio/test_resample.py). ``flush()`` at the end returns the filter's tail.
"""

from __future__ import annotations

import numpy as np

MIN_RATE, MAX_RATE = 8000, 48000
"""The output rates a request may ask for: narrowband telephony to the top of common audio hardware."""


class StreamingResampler:
    """float32 mono at ``input_rate`` in, float32 mono at ``output_rate`` out; one per stream."""

    def __init__(self, output_rate: int, input_rate: int) -> None:
        import av

        self.input_rate, self.output_rate = input_rate, output_rate
        self._resampler = av.AudioResampler(format="flt", layout="mono", rate=output_rate)
        self._done = False

    def process(self, pcm: np.ndarray) -> np.ndarray:
        """The output ready after ``pcm`` (a few samples stay in the filter until more input or ``flush``)."""
        if self._done:
            raise RuntimeError("resampler already flushed")
        if not len(pcm):
            return np.zeros(0, np.float32)
        return _joined(self._resampler.resample(mono_frame(pcm, self.input_rate)))

    def flush(self) -> np.ndarray:
        """The filter's tail: the last samples of the stream. Nothing may follow."""
        if self._done:
            return np.zeros(0, np.float32)
        self._done = True
        return _joined(self._resampler.resample(None))


def resample(pcm: np.ndarray, output_rate: int, input_rate: int) -> np.ndarray:
    """All of ``pcm`` at ``output_rate`` (the same samples a stream of its chunks gives)."""
    if output_rate == input_rate:
        return pcm
    resampler = StreamingResampler(output_rate, input_rate)
    return np.concatenate([resampler.process(pcm), resampler.flush()])


def mono_frame(pcm: np.ndarray, rate: int):
    """``pcm`` (float32 mono) as a PyAV frame at ``rate``, for libswresample and FFmpeg's filters."""
    import av

    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(pcm, np.float32)[None, :], format="flt", layout="mono")
    frame.sample_rate = rate
    return frame


def _joined(frames) -> np.ndarray:
    if not frames:
        return np.zeros(0, np.float32)
    return np.concatenate([f.to_ndarray().reshape(-1) for f in frames]).astype(np.float32, copy=False)
