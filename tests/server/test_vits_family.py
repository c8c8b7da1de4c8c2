"""VITS served: a live in-process server on the tiny random VITS checkpoint (MMS-TTS layout, 16 kHz), detected from
its files, through the OpenAI route with the ``openai`` SDK and the native routes: formats at the model's rate and
resampled, ``speed`` as VITS's speaking rate, streaming by sentence, captions, a foreign option refused by name,
requests batched together, and a seed's audio the same alone and in a batch."""

from __future__ import annotations

import io
import threading
import wave

import httpx
import numpy as np
import pytest

from chattts_serve.models.vits.random_checkpoint import write_random
from chattts_serve.server.app import create_app
from tests.support.servers import (
    app_config,
    burst_behind_a_held_batch,
    check_openai_error,
    free_port,
    serving,
)

RATE = 16000
TEXT = "Hello, World! The quick brown fox."
TIMEOUT = 60
BATCH_BOUND = 1e-5  # a row in a batch against itself alone (tests/models/vits/test_model.py)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """The server and its engine, on a checkpoint written by the CLI's writer (``checkpoint random --family vits``).
    A work budget of 60 ids: "hello world" (23 ids) and "the quick brown fox" (39) run in batches of their own."""
    tmp = tmp_path_factory.mktemp("vits-server")
    root = write_random(tmp / "vits", "tiny", seed=0)
    config = app_config(
        root, tmp, port=free_port(), max_num_seqs=4, max_batch_work=60, wyoming_uri=f"tcp://127.0.0.1:{free_port()}"
    )
    app = create_app(config)
    with serving(app, config) as srv:
        yield srv.base, app.state.engine, config.wyoming.uri


@pytest.fixture
def gate(live, monkeypatch):
    """Holds each of the model's batches until a permit is released; ``batches`` records their sizes."""
    model = live[1].engine.family_model
    permits = threading.Semaphore(0)
    batches: list[int] = []
    real = model.synthesize

    def held(batch):
        assert permits.acquire(timeout=30), "the test never let this batch run"
        batches.append(len(batch))
        return real(batch)

    monkeypatch.setattr(model, "synthesize", held)
    yield permits, batches
    permits.release(100)


@pytest.fixture
def client(live):
    import openai

    return openai.OpenAI(base_url=live[0] + "/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)


def wav(data: bytes) -> tuple[np.ndarray, int]:
    with wave.open(io.BytesIO(data)) as w:
        return np.frombuffer(w.readframes(w.getnframes()), "<i2"), w.getframerate()


def tts(base: str, **body) -> httpx.Response:
    r = httpx.post(base + "/v1/tts", json={"text": TEXT, "stream": False, **body}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r


def test_a_server_with_its_warm_up_starts_on_a_vits_checkpoint(tmp_path):
    """``serve``'s default warm-up used ChatTTS's options (a 400 on another family): the server never started."""
    root = write_random(tmp_path / "vits", "tiny", seed=0)
    config = app_config(root, tmp_path, port=free_port(), warmup=True)
    with serving(create_app(config), config) as srv:
        assert httpx.get(srv.base + "/ready", timeout=TIMEOUT).status_code == 200


def test_models_name_the_family_its_rate_and_word_timestamps(live):
    data = httpx.get(live[0] + "/v1/models", timeout=TIMEOUT).json()["data"]
    assert data[0]["id"] == "vits" and {(m["family"], m["sample_rate"]) for m in data} == {("vits", RATE)}
    caps = {"streaming": "sentence", "timestamps": "word", "refine": False, "control_tokens": False}
    assert all(m["capabilities"] == caps for m in data)
    metrics = httpx.get(live[0] + "/metrics", timeout=TIMEOUT).text
    assert 'chattts_model_info{family="vits",sample_rate="16000"} 1.0' in metrics


def test_openai_sdk_wav_pcm_and_mp3_at_the_models_rate(client, live):
    import av

    speech = client.audio.speech.create
    pcm, rate = wav(
        speech(model="vits", voice="default", input=TEXT, response_format="wav", extra_body={"seed": 4}).content
    )
    assert rate == RATE and len(pcm) > 0 and np.abs(pcm).max() > 0
    raw = speech(model="tts-1", voice="default", input=TEXT, response_format="pcm", extra_body={"seed": 4}).content
    np.testing.assert_array_equal(np.frombuffer(raw, "<i2"), pcm)  # pcm: the same s16le at 16 kHz
    mp3 = speech(model="vits", voice="default", input=TEXT, response_format="mp3", extra_body={"seed": 4}).content
    with av.open(io.BytesIO(mp3)) as container:
        stream = container.streams.audio[0]
        decoded = sum(f.samples for f in container.decode(stream))
        assert stream.rate == RATE and abs(decoded - len(pcm)) <= 2 * 1152  # an mp3 frame of padding each side


def test_speed_is_vitss_speaking_rate(client):
    """OpenAI's ``speed`` divides each token's predicted duration (transformers' ``speaking_rate``): the same seed
    at speed 2 gives fewer frames; no time stretch is applied."""

    def frames(speed: float) -> int:
        body = {"seed": 4}
        data = client.audio.speech.create(
            model="vits", voice="default", input=TEXT, response_format="wav", speed=speed, extra_body=body
        ).content
        return len(wav(data)[0])

    assert frames(2.0) < frames(1.0) < frames(0.5)


QUIET = {"noise_scale": 0.0, "noise_scale_duration": 0.0}
"""No noise at all: a request's audio no longer depends on its seed."""


def test_noise_scales_reach_the_model_from_the_native_route_the_sdk_and_the_websocket(client, live):
    """VITS's own ``noise_scale`` and ``noise_scale_duration`` are request fields: with both 0 the seed changes
    nothing (every route gives the same audio), with the checkpoint's it does."""
    import json

    from websockets.sync.client import connect

    base = live[0]
    text = "Hello there."
    noisy = [tts(base, text=text, format="pcm", seed=s).content for s in (1, 2)]
    assert noisy[0] != noisy[1]
    quiet = tts(base, text=text, format="pcm", seed=1, **QUIET).content
    assert tts(base, text=text, format="pcm", seed=2, **QUIET).content == quiet
    assert tts(base, text=text, format="pcm", seed=1, noise_scale=0.0).content not in (quiet, noisy[0])
    sdk = client.audio.speech.create(
        model="vits", voice="default", input=text, response_format="pcm", extra_body={"seed": 3, **QUIET}
    ).content
    assert sdk == quiet
    with connect(base.replace("http", "ws", 1) + "/v1/tts/stream", open_timeout=TIMEOUT) as ws:
        ws.send(json.dumps({"type": "start", "text": text, "seed": 4, "format": "pcm", **QUIET}))
        ws.send(json.dumps({"type": "end"}))
        audio = b""
        while True:
            message = ws.recv(timeout=TIMEOUT)
            if isinstance(message, bytes):
                audio += message
            elif json.loads(message)["type"] in ("end", "error"):
                break
    assert audio == quiet


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"noise_scale": -0.1}, "noise_scale"),
        ({"noise_scale_duration": 11}, "noise_scale_duration"),
        ({"noise_scale": "0.5"}, "noise_scale"),
        ({"noise_scale_duration": True}, "noise_scale_duration"),
        ({"phonemes": "h@loU"}, "phonemes"),  # Kokoro's
        ({"lang_code": "a"}, "lang_code"),
    ],
)
def test_a_bad_noise_scale_or_another_familys_option_is_a_400_naming_it(live, client, gate, body, param):
    import openai

    _, batches = gate
    r = httpx.post(live[0] + "/v1/tts", json={"text": TEXT, **body}, timeout=TIMEOUT)
    assert check_openai_error(r, 400)["param"] == param
    with pytest.raises(openai.BadRequestError) as info:
        client.audio.speech.create(model="vits", voice="default", input=TEXT, extra_body=body)
    assert info.value.body["param"] == param
    assert batches == []  # refused before the engine


def test_native_route_resampled_rates_and_formats(live):
    base = live[0]
    pcm16, _ = wav(tts(base, format="wav", seed=2).content)
    for rate in (24000, 8000):
        pcm, got = wav(tts(base, format="wav", seed=2, sample_rate=rate).content)
        assert got == rate and abs(len(pcm) - len(pcm16) * rate // RATE) <= 16
    raw = tts(base, format="pcm", seed=2, sample_rate=24000).content
    assert abs(len(raw) // 2 - len(pcm16) * 3 // 2) <= 16
    assert len(tts(base, format="mulaw", seed=2).content) == pytest.approx(len(pcm16) // 2, abs=16)  # 8 kHz, 1 B
    flac = tts(base, format="flac", seed=2).content
    assert flac[:4] == b"fLaC"
    r = httpx.post(base + "/v1/tts", json={"text": TEXT, "format": "mp3", "sample_rate": 24000}, timeout=TIMEOUT)
    assert check_openai_error(r, 400)["param"] == "sample_rate"


def test_captions_are_the_engines_sentence_spans(live):
    base = live[0]
    doc = httpx.post(
        base + "/v1/tts/captioned", json={"text": TEXT, "format": "wav", "seed": 2}, timeout=TIMEOUT
    ).json()
    pcm, _ = wav(tts(base, format="wav", seed=2).content)
    assert doc["sample_rate"] == RATE and doc["duration_s"] == len(pcm) / RATE
    first, second = doc["segments"]
    assert (first["text"], second["text"]) == ("Hello, World!", "The quick brown fox.")
    assert first["start_s"] == 0 and first["end_s"] == second["start_s"] < second["end_s"] == doc["duration_s"]


def test_a_chattts_only_option_is_a_400_naming_it_and_its_family(client, live, gate):
    import openai

    _, batches = gate
    for option in ({"refine_text": False}, {"temperature": 0.5}, {"prompt": "[speed_3]"}):
        with pytest.raises(openai.BadRequestError) as info:
            client.audio.speech.create(model="vits", voice="default", input=TEXT, extra_body=option)
        [name] = option
        assert info.value.body["param"] == name and info.value.body["code"] == "unsupported_option"
        message = info.value.body["message"]
        assert f"option '{name}' belongs to the chattts family; this model is a vits model" in message
    r = httpx.post(live[0] + "/v1/tts", json={"text": TEXT, "top_k": 3}, timeout=TIMEOUT)
    assert check_openai_error(r, 400)["param"] == "top_k"
    r = httpx.post(live[0] + "/v1/tts", json={"text": TEXT, "voice": "alloy"}, timeout=TIMEOUT)
    assert check_openai_error(r, 400)["code"] == "unknown_voice"  # ChatTTS's names are not this checkpoint's
    r = httpx.post(live[0] + "/v1/tts", json={"text": TEXT, "voice": "speaker_1"}, timeout=TIMEOUT)
    assert "its only voice is 'default'" in check_openai_error(r, 400)["message"]
    assert batches == []  # refused before the engine


def test_the_first_sentence_streams_before_the_second_runs(live, gate):
    """Each sentence is a batch of its own (the work budget): the second is held in the model until the client
    has read audio; it arrives before the second has run, and the stream's whole is the unstreamed audio."""
    base, engine, _ = live
    permits, batches = gate
    permits.release(1)
    whole_body = {"text": TEXT, "format": "pcm", "seed": 9}
    with httpx.stream("POST", base + "/v1/tts", json={**whole_body, "stream": True}, timeout=TIMEOUT) as r:
        chunks = r.iter_bytes()
        first = next(chunks)
        assert first and batches == [1]  # only the first sentence has run
        permits.release(10)
        streamed = first + b"".join(chunks)
    assert batches == [1, 1]
    assert streamed == tts(base, **whole_body).content


def test_concurrent_requests_share_a_batch_and_each_equals_itself_alone(live, gate):
    """While the first request's batch is held, three more arrive and run together in the next batch (within the
    budget of 60 ids); each request's audio equals its audio alone (the same seed)."""
    base, engine, _ = live
    permits, batches = gate
    texts = {0: "First one.", 1: "Second.", 2: "Third, too.", 3: "Fourth"}  # 13 + 21 + 13 ids
    results: dict[int, bytes] = {}

    def post(i: int) -> None:
        body = {"text": texts[i], "format": "pcm", "stream": False, "seed": 100 + i}
        results[i] = httpx.post(base + "/v1/tts", json=body, timeout=TIMEOUT).content

    burst_behind_a_held_batch(engine, post, lambda: permits.release(100), TIMEOUT)
    assert batches == [1, 3]
    for i in texts:
        alone = tts(base, text=texts[i], format="pcm", seed=100 + i).content
        assert len(alone) == len(results[i])  # durations exact
        a, b = (np.frombuffer(x, "<i2").astype(np.int32) for x in (alone, results[i]))
        assert int(np.abs(a - b).max()) <= 1  # the waveforms within BATCH_BOUND: at most 1 LSB of s16


def test_wyoming_speaks_it_at_the_models_rate(live):
    """Home Assistant's protocol (the ``wyoming`` package's client): the checkpoint's one voice is listed, and a
    request's audio is at 16 kHz and equals the same request over HTTP (the options extension sets the seed)."""
    import asyncio

    from wyoming.audio import AudioChunk, AudioStart
    from wyoming.client import AsyncTcpClient
    from wyoming.info import Describe, Info
    from wyoming.tts import Synthesize, SynthesizeVoice

    base, _, uri = live
    port = int(uri.rsplit(":", 1)[1])

    async def talk():
        async with AsyncTcpClient("127.0.0.1", port, connect_timeout=10, read_timeout=TIMEOUT) as c:
            await c.write_event(Describe().event())
            info = Info.from_event(await c.read_event())
            event = Synthesize(text=TEXT, voice=SynthesizeVoice(name="default")).event()
            event.data["chattts"] = {"seed": 5}
            await c.write_event(event)
            events = []
            while (e := await c.read_event()) is not None:
                events.append(e)
                if e.type in ("audio-stop", "error"):
                    return info, events

    info, events = asyncio.run(asyncio.wait_for(talk(), TIMEOUT))
    program = info.tts[0]
    assert program.name == "vits" and program.description == "VITS text to speech, 16000 Hz (chattts-serve)"
    [voice] = program.voices
    assert (voice.name, voice.languages) == ("default", ["en"])  # tokenizer_config.json's "eng"
    assert voice.description == "default (the checkpoint's one speaker)"
    assert AudioStart.from_event(events[0]).rate == RATE and events[-1].type == "audio-stop"
    pcm = b"".join(AudioChunk.from_event(e).audio for e in events if AudioChunk.is_type(e.type))
    assert pcm == tts(base, format="pcm", seed=5).content


def test_dialogue_and_websocket(live):
    """``/v1/dialogue``: turns back to back with the pause at 16 kHz, each turn its own audio. The WebSocket: text
    in pieces, audio and sentence events at the model's rate."""
    import json

    from websockets.sync.client import connect

    base = live[0]
    turns = [{"text": "Hello there.", "seed": 1}, {"text": "General Kenobi.", "seed": 2}]
    body = {"turns": turns, "stream": False, "format": "pcm", "pause_ms": 250}
    r = httpx.post(base + "/v1/dialogue", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    parts = [tts(base, text=t["text"], seed=t["seed"], format="pcm").content for t in turns]
    assert r.content == parts[0] + bytes(2 * RATE * 250 // 1000) + parts[1]

    with connect(base.replace("http", "ws", 1) + "/v1/tts/stream", open_timeout=TIMEOUT) as ws:
        ws.send(json.dumps({"type": "start", "text": "Hello there. ", "timestamps": True, "seed": 1}))
        ws.send(json.dumps({"type": "text", "text": "General Kenobi."}))
        ws.send(json.dumps({"type": "end"}))
        events, audio = [], b""
        while True:
            message = ws.recv(timeout=TIMEOUT)
            if isinstance(message, bytes):
                audio += message
                continue
            events.append(json.loads(message))
            if events[-1]["type"] in ("end", "error"):
                break
    assert events[0] == {**events[0], "type": "start", "sample_rate": RATE}
    segments = [e for e in events if e["type"] == "segment"]
    assert [s["text"] for s in segments] == ["Hello there.", "General Kenobi."] and events[-1]["type"] == "end"
    assert segments[0]["end_s"] == segments[1]["start_s"]
    assert segments[1]["end_s"] * RATE == pytest.approx(len(audio) // 2)


@pytest.fixture(scope="module")
def multi(tmp_path_factory):
    """A 3-speaker checkpoint, with the result cache on."""
    tmp = tmp_path_factory.mktemp("vits-multi")
    root = write_random(tmp / "vits", "tiny", seed=1, num_speakers=3, speaker_embedding_size=8)
    config = app_config(root, tmp, port=free_port(), cache_mb=8)
    app = create_app(config)
    with serving(app, config) as srv:
        yield srv.base


def test_speakers_are_voices_blends_and_saved_voices(multi):
    def speak(voice: str | None, **body) -> httpx.Response:
        return httpx.post(
            multi + "/v1/tts",
            json={"text": "Hello there.", "format": "pcm", "stream": False, "seed": 3, "voice": voice, **body},
            timeout=TIMEOUT,
        )

    zero, two = speak("speaker_0").content, speak("speaker_2").content
    assert speak(None).content == zero and zero != two  # no voice: speaker 0
    blend = speak("speaker_0(1)+speaker_2(3)")
    assert blend.status_code == 200 and blend.content not in (zero, two)
    assert speak("speakers:0=0.25,2=0.75").content == blend.content  # the blend's voice string
    r = httpx.post(multi + "/v1/voices", json={"name": "mix", "speaker": "speakers:0=0.25,2=0.75"}, timeout=TIMEOUT)
    assert r.status_code == 201, r.text
    assert speak("mix").content == blend.content
    r = httpx.post(multi + "/v1/voices", json={"name": "rnd", "seed": 1}, timeout=TIMEOUT)
    assert "ChatTTS's" in check_openai_error(r, 400)["message"]  # random speakers are ChatTTS's
    assert "speakers 0 .. 2, got speaker 7" in check_openai_error(speak("speaker_7"), 400)["message"]


def test_wyoming_describe_lists_a_multi_speaker_checkpoints_speakers(tmp_path):
    """The family's voices and language, without a server: each speaker, and a saved voice in their language."""
    from types import SimpleNamespace

    from chattts_serve import models
    from chattts_serve.models.vits.voices import VitsVoices
    from chattts_serve.server.voices import VoiceStore
    from chattts_serve.server.wyoming import _build_info

    store = VoiceStore(str(tmp_path / "voices.db"))
    store.add("mix", speaker="speakers:0=0.5,2=0.5")
    engine = SimpleNamespace(family=models.get("vits"), voices=VitsVoices(3, "kor"), sample_rate=22050)
    program = _build_info(store, engine).tts[0]
    store.close()
    assert [(v.name, v.languages) for v in program.voices] == [
        ("speaker_0", ["ko"]), ("speaker_1", ["ko"]), ("speaker_2", ["ko"]), ("mix", ["ko"])
    ]
    assert program.voices[2].description == "speaker_2 (speaker id 2 of 3)"
    assert "22050 Hz" in program.description


def test_a_seeded_request_is_cached_and_the_cache_knows_the_family(multi):
    first, again = (
        httpx.post(
            multi + "/v1/tts", json={"text": "Cache me.", "format": "wav", "seed": 8, "stream": False}, timeout=TIMEOUT
        )
        for _ in range(2)
    )
    assert (first.headers["X-Cache"], again.headers["X-Cache"]) == ("miss", "hit")
    assert first.content == again.content
    other = httpx.post(
        multi + "/v1/tts",
        json={"text": "Cache me.", "format": "wav", "seed": 8, "voice": "speaker_1", "stream": False},
        timeout=TIMEOUT,
    )
    assert other.headers["X-Cache"] == "miss" and other.content != first.content
