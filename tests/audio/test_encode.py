"""audio/encode.py: every format is a file its decoder opens, even with no audio at all."""

from __future__ import annotations

import io

import av
import numpy as np
import pytest

from chattts_serve.audio.encode import FORMATS, StreamingEncoder, check_rate, encode_whole
from chattts_serve.audio.resample import resample

RATE = 24000
"""The model's rate the encoders are tested at (ChatTTS's)."""

HEADERLESS = ("pcm", "mulaw", "alaw")


def _decoded_samples(data: bytes, fmt: str | None = None, rate: int = 8000) -> np.ndarray:
    """Decoded by FFmpeg (a headerless format needs its name and rate)."""
    options = {"sample_rate": str(rate)} if fmt else {}
    with av.open(io.BytesIO(data), format=fmt, options=options) as container:
        frames = [f.to_ndarray().reshape(-1) for f in container.decode(audio=0)]
    return np.concatenate(frames) if frames else np.zeros(0)


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f not in HEADERLESS])
def test_empty_audio_is_a_file_its_decoder_opens(fmt):
    """A request that ends at step 0 has no audio: an Ogg Opus, MP3 or ADTS stream without a single frame (0
    bytes) is no file at all, so they carry the shortest silence their codec makes."""
    for data in (encode_whole(np.zeros(0, np.float32), fmt, model_rate=RATE), _streamed_empty(fmt)):
        samples = _decoded_samples(data)
        assert len(samples) <= 2048 and not np.abs(samples).max(initial=0) > 1e-3


def _streamed_empty(fmt: str) -> bytes:
    encoder = StreamingEncoder(fmt, model_rate=RATE)
    return encoder.write(np.zeros(0, np.float32)) + encoder.finish()


@pytest.mark.parametrize("fmt", HEADERLESS)
def test_empty_headerless_is_empty(fmt):
    assert encode_whole(np.zeros(0, np.float32), fmt, model_rate=RATE) == b""
    assert _streamed_empty(fmt) == b""


def test_audio_gets_no_extra_samples():
    pcm = np.sin(np.arange(24000) / 10).astype(np.float32) * 0.5
    assert len(_decoded_samples(encode_whole(pcm, "flac", model_rate=RATE))) == 24000


def _speechlike(seconds: float = 1.0) -> np.ndarray:
    t = np.arange(int(seconds * 24000)) / 24000
    return (0.3 * np.sin(2 * np.pi * 220 * t) + 0.2 * np.sin(2 * np.pi * 1250 * t)).astype(np.float32)


@pytest.mark.parametrize("fmt", ["mulaw", "alaw"])
def test_g711_is_8khz_one_byte_a_sample(fmt):
    """G.711 as Twilio and SIP gateways take it: headerless, 8 kHz, one byte per sample, FFmpeg's codec; it
    decodes to the 8 kHz resampling of the audio within G.711's quantisation (8 bits, companded)."""
    pcm = _speechlike()
    data = encode_whole(pcm, fmt, model_rate=RATE)
    assert len(data) == 8000
    decoded = _decoded_samples(data, fmt).astype(np.float32) / 32768
    reference = resample(pcm, 8000, RATE)
    assert np.abs(decoded - reference).max() < 0.02  # a quantisation step at 0.5 is 1/64 in G.711
    assert data != encode_whole(pcm, "alaw" if fmt == "mulaw" else "mulaw", model_rate=RATE)


@pytest.mark.parametrize("fmt", ["pcm", "wav", "flac", "mulaw", "alaw"])
@pytest.mark.parametrize("rate", [8000, 16000, 44100, 48000])
def test_sample_rate_streamed_equals_whole(fmt, rate):
    """Streamed in 20 ms chunks (with empty ones between) or encoded whole: the same bytes at the asked rate
    (wav: only the header's sizes differ)."""
    pcm = _speechlike()
    whole = encode_whole(pcm, fmt, rate, model_rate=RATE)
    encoder = StreamingEncoder(fmt, rate, model_rate=RATE)
    parts = [encoder.write(pcm[i : i + 480]) + encoder.write(pcm[:0]) for i in range(0, len(pcm), 480)]
    streamed = b"".join(parts) + encoder.finish()
    assert encoder.samples_out == rate
    if fmt == "wav":
        assert whole[44:] == streamed[44:] and whole[24:28] == streamed[24:28] == rate.to_bytes(4, "little")
    else:
        assert streamed == whole
    if fmt in ("flac", "wav"):
        assert len(_decoded_samples(whole)) == rate
        with av.open(io.BytesIO(whole)) as container:
            assert container.streams.audio[0].sample_rate == rate


def test_rates_each_format_takes():
    assert check_rate("mulaw", None, RATE) == check_rate("alaw", None, RATE) == 8000
    assert check_rate("pcm", None, RATE) == check_rate("mp3", None, RATE) == 24000
    assert check_rate("pcm", 16000, RATE) == 16000 and check_rate("mp3", 24000, RATE) == 24000
    for fmt, rate, why in [
        ("mp3", 16000, "applies to pcm, wav, flac, mulaw, alaw"),
        ("opus", 48000, "always encoded at 24000"),
        ("wav", 7999, "between 8000 and 48000"),
        ("pcm", 96000, "between 8000 and 48000"),
        ("ogg", None, "unsupported format"),
    ]:
        with pytest.raises(ValueError, match=why):
            check_rate(fmt, rate, RATE)
