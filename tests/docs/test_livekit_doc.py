"""docs/livekit.md: the example, run as written (its address replaced by a test server's) with LiveKit's own
OpenAI plugin, writes the speech: 24 kHz, the same audio as a direct request."""

from __future__ import annotations

import wave

import httpx
import numpy as np
import pytest

from ..server.conftest import HTTP_TIMEOUT, SR, expected_samples
from .conftest import FIXED_TOKENS
from .doc_blocks import DOC_URL, run_block, tagged_blocks

pytestmark = pytest.mark.e2e

pytest.importorskip("livekit.plugins.openai")

BLOCKS = tagged_blocks("livekit.md")


def test_every_example_is_tested():
    assert set(BLOCKS) == {"livekit-tts"}


def test_synthesize_writes_the_speech(fixed_server, tmp_path):
    run_block(BLOCKS["livekit-tts"], tmp_path, {DOC_URL: fixed_server})
    with wave.open(str(tmp_path / "livekit.wav")) as wav:
        assert (wav.getframerate(), wav.getsampwidth(), wav.getnchannels()) == (SR, 2, 1)
        samples = np.frombuffer(wav.readframes(wav.getnframes()), dtype="<i2")
    body = {"model": "gpt-4o-mini-tts", "voice": "alloy", "input": "今天天气真不错。", "response_format": "pcm"}
    r = httpx.post(fixed_server + "/v1/audio/speech", json=body, timeout=HTTP_TIMEOUT)
    n = expected_samples(FIXED_TOKENS)
    # LiveKit may end the segment with a 10 ms silent frame of its own
    assert len(samples) - n in (0, SR // 100) and not samples[n:].any()
    assert samples[:n].tobytes() == r.content
