"""docs/openai.md: each example, run as written (its address replaced by a test server's) with the
official ``openai`` SDK, makes the audio it says it makes."""

from __future__ import annotations

import httpx
import pytest

from ..server.conftest import HTTP_TIMEOUT, SR, decode_audio, running_server
from .doc_blocks import DOC_URL, run_block, tagged_blocks

pytestmark = pytest.mark.e2e

pytest.importorskip("openai")

BLOCKS = tagged_blocks("openai.md")


@pytest.fixture(scope="module")
def server(tiny_ckpt, tmp_path_factory):
    with running_server(tiny_ckpt, tmp_path_factory.mktemp("openai-doc"), "--max-num-seqs", "4") as base:
        yield base


def _speech_samples(server: str, **body) -> int:
    """Samples of the same request made directly (pcm), for comparison with what the example wrote."""
    r = httpx.post(f"{server}/v1/audio/speech", json={**body, "response_format": "pcm"}, timeout=HTTP_TIMEOUT)
    assert r.status_code == 200, r.text
    return len(r.content) // 2


def test_every_example_is_tested():
    assert set(BLOCKS) == {
        "openai-speech",
        "openai-stream-to-file",
        "openai-stream-chunks",
        "openai-options",
        "openai-async",
    }


def test_speech(server, tmp_path):
    run_block(BLOCKS["openai-speech"], tmp_path, {DOC_URL: server})
    audio, rate = decode_audio((tmp_path / "speech.wav").read_bytes(), "wav")
    assert rate == SR
    assert len(audio) == _speech_samples(server, model="tts-1", voice="alloy", input="今天天气真不错。", seed=7)


def test_stream_to_file(server, tmp_path):
    run_block(BLOCKS["openai-stream-to-file"], tmp_path, {DOC_URL: server})
    audio, rate = decode_audio((tmp_path / "speech.mp3").read_bytes(), "mp3")
    text = "今天天气真不错，我们一起去公园散步吧。"
    expected = _speech_samples(server, model="tts-1", voice="nova", input=text, seed=7)
    assert rate == SR
    assert len(audio) == pytest.approx(expected, abs=0.1 * SR)  # mp3 frames pad the ends


def test_stream_chunks(server, tmp_path):
    out = run_block(BLOCKS["openai-stream-chunks"], tmp_path, {DOC_URL: server})
    assert out.startswith("first audio after ") and out.rstrip().endswith(" s"), out
    pcm = (tmp_path / "speech.pcm").read_bytes()
    assert len(pcm) > 0 and len(pcm) % 2 == 0 and (len(pcm) // 2 + 256) % 512 == 0


def test_options_and_saved_voice(server, tmp_path):
    body = {
        "model": "tts-1",
        "voice": "narrator",
        "input": "今天天气真不错。",
        "speed": 1.25,
        "seed": 7,
        "temperature": 0.3,
        "top_p": 0.7,
        "top_k": 20,
        "refine_prompt": "[oral_2][laugh_0][break_4]",
    }
    for _ in range(2):  # a second run finds the voice saved (409) and still works
        run_block(BLOCKS["openai-options"], tmp_path, {DOC_URL: server})
        audio, rate = decode_audio((tmp_path / "narrator.flac").read_bytes(), "flac")
        assert rate == SR and len(audio) == _speech_samples(server, **body)
    assert httpx.get(f"{server}/v1/voices/narrator", timeout=HTTP_TIMEOUT).json()["kind"] == "speaker"


def test_async(server, tmp_path):
    out = run_block(BLOCKS["openai-async"], tmp_path, {DOC_URL: server})
    expected = _speech_samples(server, model="tts-1", voice="echo", input="今天天气真不错。", seed=7)
    assert out == f"{expected / SR:.2f} s of audio\n"
