"""audio/encode.py: every format is a file its decoder opens, even with no audio at all."""

from __future__ import annotations

import io

import av
import numpy as np
import pytest

from chattts_serve.audio.encode import FORMATS, StreamingEncoder, encode_whole


def _decoded_samples(data: bytes) -> np.ndarray:
    with av.open(io.BytesIO(data)) as container:
        frames = [f.to_ndarray().reshape(-1) for f in container.decode(audio=0)]
    return np.concatenate(frames) if frames else np.zeros(0)


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f != "pcm"])
def test_empty_audio_is_a_file_its_decoder_opens(fmt):
    """A request that ends at step 0 has no audio: an Ogg Opus, MP3 or ADTS stream without a single frame (0
    bytes) is no file at all, so they carry the shortest silence their codec makes."""
    for data in (encode_whole(np.zeros(0, np.float32), fmt), _streamed_empty(fmt)):
        samples = _decoded_samples(data)
        assert len(samples) <= 2048 and not np.abs(samples).max(initial=0) > 1e-3


def _streamed_empty(fmt: str) -> bytes:
    encoder = StreamingEncoder(fmt)
    return encoder.write(np.zeros(0, np.float32)) + encoder.finish()


def test_empty_pcm_is_empty():
    assert encode_whole(np.zeros(0, np.float32), "pcm") == b""


def test_audio_gets_no_extra_samples():
    pcm = np.sin(np.arange(24000) / 10).astype(np.float32) * 0.5
    assert len(_decoded_samples(encode_whole(pcm, "flac"))) == 24000
