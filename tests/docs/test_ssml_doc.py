"""docs/ssml.md: each example, run as written (its address replaced by a test server's), makes the audio of the
plain text it stands for."""

from __future__ import annotations

import httpx
import pytest

from ..server.conftest import HTTP_TIMEOUT, decode_audio, running_server
from .conftest import FIXED_DEFAULTS
from .doc_blocks import DOC_URL, run_block, tagged_blocks

pytest.importorskip("openai")

BLOCKS = tagged_blocks("ssml.md")


@pytest.fixture(scope="module")
def server(tiny_ckpt, tmp_path_factory):
    """In this process; every request FIXED_TOKENS steps long (the examples set no length). One KV slot: the
    <voice> example's turns decode one after another, so it is the dialogue's audio byte for byte
    (tests/server/test_ssml_turns.py says why more slots may round a sample differently)."""
    tmp = tmp_path_factory.mktemp("ssml-doc")
    flags = ("--default-options", FIXED_DEFAULTS, "--max-num-seqs", "1")
    with running_server(tiny_ckpt, tmp, *flags, in_process=True) as base:
        yield base


def _direct(server: str, text: str, **body) -> bytes:
    body = {"text": text, "format": "pcm", "stream": False, "seed": 7, **body}
    r = httpx.post(f"{server}/v1/tts", json=body, timeout=HTTP_TIMEOUT)
    assert r.status_code == 200, r.text
    return r.content


def test_every_example_is_tested():
    assert set(BLOCKS) == {"ssml-openai", "ssml-voice", "ssml-lexicon"}


def test_ssml_through_the_openai_sdk(server, tmp_path):
    from chattts_serve.text.lexicon import homophone

    run_block(BLOCKS["ssml-openai"], tmp_path, {DOC_URL: server})
    audio, _ = decode_audio((tmp_path / "ssml.wav").read_bytes(), "wav")
    plain = f"今天[lbreak]天气真不错。 请拨打四零零，幺二三，四五六七， 他{homophone('zhang3')}大了。"
    body = {"model": "tts-1", "voice": "alloy", "input": plain, "response_format": "pcm", "seed": 7}
    r = httpx.post(
        f"{server}/v1/audio/speech", json={**body, "refine_text": False, "prompt": "[speed_4]"}, timeout=HTTP_TIMEOUT
    )
    assert r.status_code == 200, r.text
    assert audio.tobytes() == r.content


def test_a_request_lexicon(server, tmp_path):
    from chattts_serve.text.lexicon import homophone

    run_block(BLOCKS["ssml-lexicon"], tmp_path, {DOC_URL: server})
    audio, _ = decode_audio((tmp_path / "lexicon.wav").read_bytes(), "wav")
    h = homophone
    plain = f"我们在{h('yin2')}{h('hang2')}门口见，然后去{h('chang2')}{h('cheng2')}。"
    assert audio.tobytes() == _direct(server, plain)


def test_voices_are_the_dialogues_turns(server, tmp_path):
    run_block(BLOCKS["ssml-voice"], tmp_path, {DOC_URL: server})
    audio, _ = decode_audio((tmp_path / "dialogue.wav").read_bytes(), "wav")
    turns = [
        {"voice": "alloy", "text": "今天天气真不错。"},
        {"voice": "nova", "text": "是啊，我们去公园吧。"},
        {"voice": "alloy(2)+echo(1)", "text": "好的，走吧。", "prompt": "[speed_6]"},
    ]
    body = {"turns": [{**t, "seed": 7, "refine_text": False} for t in turns], "format": "pcm", "stream": False}
    r = httpx.post(f"{server}/v1/dialogue", json=body, timeout=HTTP_TIMEOUT)
    assert r.status_code == 200, r.text
    assert audio.tobytes() == r.content
    one_voice = httpx.post(
        f"{server}/v1/tts",
        json={"text": "".join(t["text"] for t in turns), "format": "pcm", "stream": False, "seed": 7},
        timeout=HTTP_TIMEOUT,
    )
    assert one_voice.status_code == 200 and len(one_voice.content) < len(r.content)  # three turns, two pauses
