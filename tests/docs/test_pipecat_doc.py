"""docs/pipecat.md: the example, run as written (its address replaced by a test server's) with Pipecat's own
``OpenAITTSService``, writes the bot's speech: 24 kHz, one request per sentence, the same audio as direct
requests."""

from __future__ import annotations

import wave

import httpx
import pytest

from ..server.conftest import HTTP_TIMEOUT, SR, expected_samples
from .conftest import FIXED_TOKENS
from .doc_blocks import DOC_URL, run_block, tagged_blocks

pytestmark = pytest.mark.e2e

pytest.importorskip("pipecat")

BLOCKS = tagged_blocks("pipecat.md")


def test_every_example_is_tested():
    assert set(BLOCKS) == {"pipecat-tts"}


def test_pipeline_writes_the_speech(fixed_server, tmp_path):
    run_block(BLOCKS["pipecat-tts"], tmp_path, {DOC_URL: fixed_server})
    with wave.open(str(tmp_path / "pipecat.wav")) as wav:
        assert (wav.getframerate(), wav.getsampwidth(), wav.getnchannels()) == (SR, 2, 1)
        frames = wav.readframes(wav.getnframes())
    direct = b""
    for text in ("今天天气真不错。", "我们去公园吧。"):
        body = {"model": "gpt-4o-mini-tts", "voice": "marin", "input": text, "response_format": "pcm"}
        r = httpx.post(fixed_server + "/v1/audio/speech", json=body, timeout=HTTP_TIMEOUT)
        assert r.status_code == 200, r.text
        direct += r.content
    assert len(frames) == 2 * 2 * expected_samples(FIXED_TOKENS) and frames == direct
