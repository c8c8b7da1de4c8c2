"""docs/wyoming.md: each example, run as written (its port replaced by a test server's) with the ``wyoming``
package's client, makes the audio it says it makes."""

from __future__ import annotations

import wave

import httpx
import pytest

from ..server.conftest import HTTP_TIMEOUT, SR, expected_samples, free_port, start_server
from .conftest import FIXED_DEFAULTS, FIXED_TOKENS
from .doc_blocks import run_block, tagged_blocks

pytestmark = pytest.mark.e2e

BLOCKS = tagged_blocks("wyoming.md")
DOC_PORT = "10200"


@pytest.fixture(scope="module")
def server(tiny_ckpt, tmp_path_factory):
    """HTTP and Wyoming in one process, every request seeded and FIXED_TOKENS steps long; yields (base URL, port)."""
    port = free_port()
    with start_server(
        tiny_ckpt,
        tmp_path_factory.mktemp("wyoming-doc"),
        "--wyoming-uri", f"tcp://127.0.0.1:{port}",
        "--default-options", FIXED_DEFAULTS,
    ) as srv:  # fmt: skip
        yield srv.base, port


def test_every_example_is_tested():
    assert set(BLOCKS) == {"wyoming-synthesize", "wyoming-stream"}


def test_synthesize(server, tmp_path):
    base, port = server
    run_block(BLOCKS["wyoming-synthesize"], tmp_path, {DOC_PORT: str(port)})
    with wave.open(str(tmp_path / "wyoming.wav")) as wav:
        assert (wav.getframerate(), wav.getsampwidth(), wav.getnchannels()) == (SR, 2, 1)
        frames = wav.readframes(wav.getnframes())
    # the same voice and (default) options over HTTP: the same audio
    body = {"text": "今天天气真不错。", "voice": "alloy", "format": "pcm"}
    r = httpx.post(base + "/v1/tts", json=body, timeout=HTTP_TIMEOUT)
    assert len(frames) == 2 * expected_samples(FIXED_TOKENS) and frames == r.content


def test_stream(server, tmp_path):
    _, port = server
    out = run_block(BLOCKS["wyoming-stream"], tmp_path, {DOC_PORT: str(port)})
    # two sentences, one fixed-length utterance each
    assert out.strip() == f"{2 * expected_samples(FIXED_TOKENS) / SR:.3f} s of audio"
