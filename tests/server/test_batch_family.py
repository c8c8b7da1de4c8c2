"""A "batch" model family served: a live in-process server on the test-only sine family (16 kHz; its own
voices and option; tests/support/sine_family.py), through the OpenAI route with the ``openai`` SDK and the
native routes: the family's rate in every format, its voices and blends, a ChatTTS-only option refused by
name, requests batched together, and a client that leaves."""

from __future__ import annotations

import io
import json
import threading
import wave

import httpx
import numpy as np
import pytest

from chattts_serve.server.app import create_app
from tests.support.servers import (
    app_config,
    burst_behind_a_held_batch,
    check_openai_error,
    free_port,
    serving,
    wait_until,
)
from tests.support.sine_family import FRAME, RATE, registered

TEXT = "One two three. Four five!"
WORDS = ("One", "two", "three.", "Four", "five!")
TIMEOUT = 60


def samples(words, speed: float = 1.0) -> int:
    return sum(max(1, round((2 + len(w)) / speed)) * FRAME for w in words)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """The server, and the sine model it loaded (detected from the checkpoint's files)."""
    tmp = tmp_path_factory.mktemp("sine-server")
    with registered() as family:
        root = family.write_random(tmp / "sine")
        config = app_config(root, tmp, port=free_port(), max_num_seqs=4, max_batch_work=3)
        app = create_app(config)
        with serving(app, config) as srv:
            yield srv.base, app.state.engine


@pytest.fixture
def model(live):
    m = live[1].engine.family_model
    m.batches.clear()
    yield m
    m.gate = None


@pytest.fixture
def client(live):
    import openai

    return openai.OpenAI(base_url=live[0] + "/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)


def wav(data: bytes) -> tuple[np.ndarray, int]:
    with wave.open(io.BytesIO(data)) as w:
        pcm = np.frombuffer(w.readframes(w.getnframes()), "<i2")
        return pcm, w.getframerate()


def test_models_name_the_family_and_its_rate(live):
    data = httpx.get(live[0] + "/v1/models", timeout=TIMEOUT).json()["data"]
    assert [m["id"] for m in data] == ["sine", "tts-1", "tts-1-hd", "gpt-4o-mini-tts"]
    assert {(m["family"], m["sample_rate"]) for m in data} == {("sine", RATE)}
    caps = {"streaming": "sentence", "timestamps": "word", "refine": False, "control_tokens": False}
    assert all(m["capabilities"] == caps for m in data)
    metrics = httpx.get(live[0] + "/metrics", timeout=TIMEOUT).text
    assert 'chattts_model_info{family="sine",sample_rate="16000"} 1.0' in metrics


def test_the_result_cache_key_names_the_family_and_its_checkpoint(live):
    from chattts_serve.server.cache import engine_identity

    family, checkpoint, config, device = json.loads(engine_identity(live[1]))
    assert family == "sine" and '"sample_rate": 16000' in checkpoint[1] and device == "cpu"


def test_openai_sdk_speech_at_the_familys_rate(client):
    pcm, rate = wav(client.audio.speech.create(model="sine", voice="high", input=TEXT, response_format="wav").content)
    assert rate == RATE and len(pcm) == samples(WORDS)
    low, _ = wav(client.audio.speech.create(model="tts-1", voice="low", input=TEXT, response_format="wav").content)
    assert len(low) == len(pcm) and not np.array_equal(low, pcm)  # another voice, another pitch
    raw = client.audio.speech.create(model="sine", voice="low", input=TEXT, response_format="pcm", extra_body={})
    assert len(raw.content) == 2 * samples(WORDS)  # pcm: s16le at the model's rate


def test_a_resampled_rate_and_one_a_format_cannot_have(client):
    import openai

    pcm, rate = wav(
        client.audio.speech.create(
            model="sine", voice="low", input=TEXT, response_format="wav", extra_body={"sample_rate": 8000}
        ).content
    )
    assert rate == 8000 and abs(len(pcm) - samples(WORDS) // 2) <= 16
    with pytest.raises(openai.BadRequestError) as info:
        client.audio.speech.create(
            model="sine", voice="low", input=TEXT, response_format="mp3", extra_body={"sample_rate": 24000}
        )
    assert "mp3 is always encoded at 16000 Hz" in info.value.body["message"]
    assert info.value.body["param"] == "sample_rate"


def test_a_chattts_only_option_is_a_400_naming_it_and_its_family(client, live, model):
    import openai

    for option in ({"refine_text": False}, {"temperature": 0.5}, {"prompt": "[speed_3]"}):
        with pytest.raises(openai.BadRequestError) as info:
            client.audio.speech.create(model="sine", voice="low", input=TEXT, extra_body=option)
        [name] = option
        assert info.value.body["param"] == name and info.value.body["code"] == "unsupported_option"
        assert (
            f"option '{name}' belongs to the chattts family; this model is a sine model" in info.value.body["message"]
        )
    r = httpx.post(live[0] + "/v1/tts", json={"text": TEXT, "top_k": 3}, timeout=TIMEOUT)
    assert check_openai_error(r, 400)["param"] == "top_k"
    assert model.batches == []  # refused before the engine


def test_voices_blends_and_the_models_own_speed(live):
    base = live[0]

    def tts(**body) -> bytes:
        r = httpx.post(base + "/v1/tts", json={"text": TEXT, "format": "pcm", "stream": False, **body}, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        return r.content

    blend, low, high = tts(voice="low(1)+high(1)"), tts(voice="low"), tts(voice="hz:330")
    assert blend == high != low  # the blend's pitch is the mean: 330 Hz
    assert len(tts(voice="low", speed=2.0)) == 2 * samples(WORDS, 2.0) < len(low)
    r = httpx.post(base + "/v1/tts", json={"text": TEXT, "voice": "alloy"}, timeout=TIMEOUT)
    assert check_openai_error(r, 400)["code"] == "unknown_voice"  # ChatTTS's names are not this family's
    r = httpx.post(base + "/v1/voices", json={"name": "mine", "speaker": "hz:500"}, timeout=TIMEOUT)
    assert r.status_code == 201, r.text
    assert tts(voice="mine") == tts(voice="hz:500")  # a saved voice of this family


def test_captions_are_counted_at_the_familys_rate(live):
    r = httpx.post(live[0] + "/v1/tts/captioned", json={"text": TEXT, "format": "wav"}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["sample_rate"] == RATE and doc["duration_s"] == samples(WORDS) / RATE
    first, second = doc["segments"]
    assert first["text"] == "One two three." and first["end_s"] == second["start_s"] == samples(WORDS[:3]) / RATE
    srt = httpx.post(live[0] + "/v1/tts/captioned", json={"text": TEXT, "format": "srt"}, timeout=TIMEOUT).text
    assert "00:00:00,000 --> 00:00:00," in srt and "Four five!" in srt


def test_concurrent_requests_run_in_one_batch(live, model):
    """While the first request's batch is held, three more (one id each) arrive; they run together in the next
    batch, within the work budget of 3."""
    base, engine = live
    model.gate = threading.Semaphore(0)
    results: dict[int, bytes] = {}

    def post(i: int) -> None:
        body = {"text": f"R{i}.", "format": "pcm", "stream": False}
        results[i] = httpx.post(base + "/v1/tts", json=body, timeout=TIMEOUT).content

    burst_behind_a_held_batch(engine, post, lambda: model.gate.release(10), TIMEOUT)
    assert model.batches == [1, 3]
    assert {len(v) for v in results.values()} == {2 * samples(["R0."])}


def test_a_client_that_leaves_ends_its_request(live, model):
    """One sentence per batch (its 2 ids fill most of the budget of 3): the client reads the first sentence and
    leaves while the second is in the model; the third never runs, and the engine is idle after."""
    base, engine = live
    model.gate = threading.Semaphore(1)
    body = {"text": "One one. Two two. Three three.", "format": "pcm"}
    with httpx.stream("POST", base + "/v1/tts", json=body, timeout=TIMEOUT) as r:
        first = next(r.iter_bytes())
        assert first and wait_until(lambda: len(model.batches) == 1 and engine.stats().num_running == 1, 30)
    assert wait_until(lambda: not engine._collectors, 30)  # the server saw the client go and aborted
    model.gate.release(10)
    assert wait_until(lambda: not engine.core.has_unfinished(), 30)
    assert model.batches == [1, 1]
