"""docs/livekit.md: the example, run as written (its address replaced by a test server's) with LiveKit's own
OpenAI plugin, writes the speech: 24 kHz, the same audio as a direct request."""

from __future__ import annotations

import json
import wave

import httpx
import numpy as np
import pytest

from ..server.conftest import HTTP_TIMEOUT, SR, expected_samples, running_server
from .doc_blocks import DOC_URL, run_block, tagged_blocks

pytest.importorskip("livekit.plugins.openai")

TOKENS = 40
BLOCKS = tagged_blocks("livekit.md")


@pytest.fixture(scope="module")
def server(tiny_ckpt, tmp_path_factory):
    defaults = {"seed": 1, "refine_text": False, "min_new_tokens": TOKENS, "max_new_tokens": TOKENS}
    tmp = tmp_path_factory.mktemp("livekit-doc")
    with running_server(tiny_ckpt, tmp, "--default-options", json.dumps(defaults)) as base:
        yield base


def test_every_example_is_tested():
    assert set(BLOCKS) == {"livekit-tts"}


def test_synthesize_writes_the_speech(server, tmp_path):
    run_block(BLOCKS["livekit-tts"], tmp_path, {DOC_URL: server})
    with wave.open(str(tmp_path / "livekit.wav")) as wav:
        assert (wav.getframerate(), wav.getsampwidth(), wav.getnchannels()) == (SR, 2, 1)
        samples = np.frombuffer(wav.readframes(wav.getnframes()), dtype="<i2")
    body = {"model": "gpt-4o-mini-tts", "voice": "alloy", "input": "今天天气真不错。", "response_format": "pcm"}
    r = httpx.post(server + "/v1/audio/speech", json=body, timeout=HTTP_TIMEOUT)
    n = expected_samples(TOKENS)
    # LiveKit may end the segment with a 10 ms silent frame of its own
    assert len(samples) - n in (0, SR // 100) and not samples[n:].any()
    assert samples[:n].tobytes() == r.content
