"""docs/telephony.md: each example, run as written (its addresses replaced by a test server's and a free port),
makes the audio it says it makes: the same bytes as a direct request, at the rate it names."""

from __future__ import annotations

import httpx
import pytest

from ..server.conftest import HTTP_TIMEOUT, decode_audio, expected_samples, free_port, running_server
from .conftest import FIXED_DEFAULTS, FIXED_TOKENS
from .doc_blocks import run_block, tagged_blocks

pytestmark = pytest.mark.e2e

BLOCKS = tagged_blocks("telephony.md")
DOC_HOST = "127.0.0.1:8000"
TEXT = "您好，这里是语音助手。"


@pytest.fixture(scope="module")
def server(tiny_ckpt, tmp_path_factory):
    """Every request seeded and FIXED_TOKENS steps long, so an example's audio is a direct request's."""
    tmp = tmp_path_factory.mktemp("telephony-doc")
    with running_server(tiny_ckpt, tmp, "--default-options", FIXED_DEFAULTS, in_process=True) as base:
        yield base


def _run(server: str, name: str, tmp_path, **more: str) -> str:
    return run_block(BLOCKS[name], tmp_path, {DOC_HOST: server.removeprefix("http://"), **more})


def _direct(server: str, **body) -> bytes:
    r = httpx.post(f"{server}/v1/tts", json={"text": TEXT, **body}, timeout=HTTP_TIMEOUT)
    assert r.status_code == 200, r.text
    return r.content


def test_every_example_is_tested():
    assert set(BLOCKS) == {"telephony-http", "telephony-openai", "telephony-twilio-bridge"}


def test_http_mulaw(server, tmp_path):
    out = _run(server, "telephony-http", tmp_path)
    audio = (tmp_path / "hello.ulaw").read_bytes()
    assert audio == _direct(server, format="mulaw")
    assert abs(len(audio) - expected_samples(FIXED_TOKENS) / 3) <= 1  # 8 kHz, one byte a sample
    assert out == f"{len(audio) / 8000:.2f} s\n"


def test_openai_sample_rate(server, tmp_path):
    _run(server, "telephony-openai", tmp_path)
    samples, rate = decode_audio((tmp_path / "hello-16k.wav").read_bytes(), "wav")
    assert rate == 16000
    body = {"model": "tts-1", "voice": "alloy", "input": TEXT, "response_format": "pcm", "sample_rate": 16000}
    r = httpx.post(f"{server}/v1/audio/speech", json=body, timeout=HTTP_TIMEOUT)
    assert r.status_code == 200, r.text
    assert samples.tobytes() == r.content


def test_twilio_bridge(server, tmp_path):
    """The caller hears exactly the mulaw chattts-serve makes, in whole 20 ms frames (the last one filled up
    with mulaw silence), before the mark."""
    out = _run(server, "telephony-twilio-bridge", tmp_path, **{"8765": str(free_port())})
    heard = (tmp_path / "call.ulaw").read_bytes()
    direct = _direct(server, format="mulaw")
    assert len(heard) % 160 == 0 and len(heard) - len(direct) < 160
    assert heard[: len(direct)] == direct and set(heard[len(direct) :]) <= {0xFF}
    assert out == f"{len(heard) // 160} frames of 20 ms\n"
