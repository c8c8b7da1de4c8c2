"""Kokoro served: a live in-process server on the tiny random Kokoro checkpoint (detected from its files),
through the OpenAI route with the ``openai`` SDK and the native routes: its voices and blends, its own options,
streaming by sentence, word timestamps, requests batched together (each as it sounds alone), and audio equal
to the model called directly. Chinese text throughout: misaki's Chinese G2P runs offline."""

from __future__ import annotations

import base64
import json
import threading

import httpx
import numpy as np
import pytest
import torch

from chattts_serve import models
from chattts_serve.audio.wav import to_pcm16
from chattts_serve.models.kokoro.family import utterance_seed
from chattts_serve.models.kokoro.model import Utterance as Row
from chattts_serve.models.kokoro.sentences import sentence_chunks
from chattts_serve.models.kokoro.text import G2P, phonemes_to_ids
from chattts_serve.models.kokoro.voices import style_for
from chattts_serve.server.app import create_app
from tests.support.servers import app_config, check_openai_error, free_port, serving, wait_until

from .conftest import decode_audio

RATE = 24000
ONE = "你好，世界。"
TWO = "今天天气很好！我们去公园散步吧。"
TIMEOUT = 120


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """The server, on a tiny random checkpoint in the official layout (detected from its files)."""
    tmp = tmp_path_factory.mktemp("kokoro-server")
    root = models.get("kokoro").write_random(tmp / "kokoro", "tiny")
    wyoming = free_port()
    config = app_config(root, tmp, port=free_port(), max_num_seqs=8, wyoming_uri=f"tcp://127.0.0.1:{wyoming}")
    app = create_app(config)
    with serving(app, config) as srv:
        yield srv.base, app.state.engine, wyoming


@pytest.fixture
def client(live):
    import openai

    return openai.OpenAI(base_url=live[0] + "/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)


@pytest.fixture
def batches(live, monkeypatch):
    """Each batch the model runs (its utterances' texts), and a gate (a Semaphore) that holds each until
    released (None: not held)."""
    model = live[1].engine.family_model
    run, record = model.synthesize, Batches()

    def synthesize(batch):
        if record.gate is not None:
            assert record.gate.acquire(timeout=60), "the test never let this batch run"
        record.append([u.text for u in batch])
        return run(batch)

    monkeypatch.setattr(model, "synthesize", synthesize)
    return record


class Batches(list):
    gate: threading.Semaphore | None = None


def tts(base: str, **body) -> bytes:
    r = post(base + "/v1/tts", json={"format": "pcm", "stream": False, **body})
    assert r.status_code == 200, r.text
    return r.content


def post(url: str, **kw) -> httpx.Response:
    return httpx.post(url, timeout=TIMEOUT, **kw)


def get(url: str) -> httpx.Response:
    return httpx.get(url, timeout=TIMEOUT)


def pcm(data: bytes) -> np.ndarray:
    return np.frombuffer(data, "<i2").astype(np.int32)


def test_models_list_the_family_and_its_rate(live):
    data = get(live[0] + "/v1/models").json()["data"]
    assert data[0]["id"] == "kokoro" and {(m["family"], m["sample_rate"]) for m in data} == {("kokoro", RATE)}
    assert data[0]["capabilities"] == {"streaming": "sentence", "timestamps": "word", "refine": False,
                                       "control_tokens": False}  # fmt: skip
    assert 'chattts_model_info{family="kokoro",sample_rate="24000"} 1.0' in get(live[0] + "/metrics").text


def test_served_audio_is_the_model_called_directly(live):
    """One sentence, seed 7: the server's pcm is ``KokoroModel.synthesize``'s waveform, quantised; nothing else."""
    base, engine, _ = live
    got = tts(base, text=ONE, voice="zf_xiaobei", seed=7)
    [chunk] = sentence_chunks(G2P("z"), ONE)
    loaded = engine.engine.family_model
    style = style_for(loaded.voices.pack("zf_xiaobei"), len(chunk.phonemes))
    row = Row(
        phonemes_to_ids(chunk.phonemes, loaded.vocab), style, 1.0, torch.Generator().manual_seed(utterance_seed(7, 0))
    )
    [direct] = loaded.model.synthesize([row])
    assert got == to_pcm16(direct.audio.numpy())


def test_openai_sdk_wav_mp3_pcm_and_kokoros_own_speed(client):
    def speech(fmt: str, **kw) -> bytes:
        extra = {"seed": 3, **kw.pop("extra", {})}
        return client.audio.speech.create(
            model="kokoro", voice="zf_xiaobei", input=ONE, response_format=fmt, extra_body=extra, **kw
        ).content

    raw = pcm(speech("pcm"))
    samples, rate = decode_audio(speech("wav"), "wav")
    assert rate == RATE and np.array_equal(samples.astype(np.int32), raw)
    mp3, rate = decode_audio(speech("mp3"), "mp3")
    assert rate == RATE and abs(len(mp3) - len(raw)) < 4096  # the encoder's padding
    fast = pcm(speech("pcm", speed=2.0))
    assert len(fast) < 0.75 * len(raw)  # Kokoro's duration scale, not a time stretch of the same audio


def test_a_blend_is_the_weighted_mean_of_its_voices(live, client):
    base = live[0]
    blend = tts(base, text=ONE, voice="af_bella(2)+af_sky(1)", lang="zh", seed=1)
    assert blend == tts(base, text=ONE, voice="af_bella(0.666667)+af_sky(0.333333)", lang="zh", seed=1)
    assert blend != tts(base, text=ONE, voice="af_bella", lang="zh", seed=1)
    sdk = client.audio.speech.create(
        model="tts-1",
        voice="af_bella(2)+af_sky(1)",
        input=ONE,
        response_format="pcm",
        extra_body={"seed": 1, "lang": "zh"},
    )
    assert sdk.content == blend
    r = post(base + "/v1/voices", json={"name": "mix", "speaker": "af_bella(0.666667)+af_sky(0.333333)"})
    assert r.status_code == 201, r.text
    assert tts(base, text=ONE, voice="mix", lang="zh", seed=1) == blend  # a saved Kokoro voice


def test_native_route_rates_and_formats(live):
    base = live[0]
    n = len(tts(base, text=ONE, voice="zf_xiaobei", seed=2)) // 2
    r = post(base + "/v1/tts", json={"text": ONE, "voice": "zf_xiaobei", "seed": 2, "sample_rate": 16000})
    samples, rate = decode_audio(r.content, "wav")
    assert rate == 16000 and abs(len(samples) - n * 2 // 3) <= 16
    body = {"text": ONE, "voice": "zf_xiaobei", "seed": 2, "stream": False}
    flac, rate = decode_audio(post(base + "/v1/tts", json={**body, "format": "flac"}).content, "flac")
    assert rate == RATE and len(flac) == n
    mulaw = post(base + "/v1/tts", json={**body, "format": "mulaw"}).content
    assert abs(len(mulaw) - n // 3) <= 16  # 8 kHz, one byte a sample
    r = post(base + "/v1/tts", json={**body, "format": "mp3", "sample_rate": 16000})
    assert check_openai_error(r, 400)["param"] == "sample_rate"


def test_bad_options_and_voices_are_400s_that_name_them(live, client, batches):
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        client.audio.speech.create(model="kokoro", voice="zf_xiaobei", input=ONE, extra_body={"temperature": 0.5})
    assert info.value.body["param"] == "temperature" and info.value.body["code"] == "unsupported_option"
    assert (
        "option 'temperature' belongs to the chattts family; this model is a kokoro model" in info.value.body["message"]
    )
    base = live[0]
    for body, fragment in [
        ({"voice": "alloy"}, "unknown voice 'alloy'"),  # tiny has no af_alloy, so no alias either
        ({"voice": "af_nova"}, "no Kokoro voice 'af_nova' in this checkpoint"),
        ({"voice": "zf_xiaobei", "lang_code": "j"}, "lang_code: 'j' is not a language"),
        ({"voice": "zf_xiaobei", "phonemes": "h§"}, "not in Kokoro's vocabulary"),
        ({"voice": "zf_xiaobei", "refine_text": False}, "belongs to the chattts family"),
    ]:
        r = post(base + "/v1/tts", json={"text": ONE, **body})
        assert fragment in check_openai_error(r, 400)["message"]
    assert batches == []  # refused before the model


def test_phonemes_and_lang_code_reach_the_model(live):
    base = live[0]
    exact = tts(base, text="anything", voice="zf_xiaobei", phonemes="ni↓xau↓", seed=4)
    assert exact == tts(base, text="something else", voice="zf_xiaobei", phonemes="ni↓xau↓", seed=4)
    assert tts(base, text=ONE, voice="af_heart", lang_code="z", seed=4) == tts(
        base, text=ONE, voice="af_heart", lang="zh", seed=4
    )


def test_streaming_by_sentence_the_first_sentence_leaves_first(client, batches):
    with client.audio.speech.with_streaming_response.create(
        model="kokoro", voice="zf_xiaobei", input=TWO, response_format="pcm", stream_format="sse",
        extra_body={"seed": 5, "timestamps": True},
    ) as resp:  # fmt: skip
        events = [json.loads(b[len("data: ") :]) for b in resp.read().decode().split("\n\n") if b.strip()]
    kinds = [e["type"] for e in events]
    first = kinds.index("speech.segment")
    heard = sum(len(base64.b64decode(e["audio"])) // 2 for e in events[:first] if e["type"] == "speech.audio.delta")
    assert heard == round(events[first]["end_s"] * RATE)  # the first sentence's audio, then its event ...
    assert "speech.audio.delta" in kinds[first:]  # ... then the rest's
    assert batches == [["今天天气很好!"], ["我们去公园散步吧."]]  # the first ran alone, before the second
    segment = events[first]
    assert [w["word"] for w in segment["words"]] == ["今天天气", "很", "好"]
    assert set(segment["words"][0]) == {"word", "start_time", "end_time"}


def test_captioned_word_timestamps(live):
    base = live[0]
    body = {"text": TWO, "voice": "zf_xiaobei", "seed": 6, "format": "pcm", "captions": "srt"}
    doc = post(base + "/v1/tts/captioned", json=body).json()
    samples = len(base64.b64decode(doc["audio"])) // 2
    expected = [
        [t.text for t in chunk.tokens if any(c.isalnum() for c in t.text)]
        for chunk in sentence_chunks(G2P("z"), TWO)
    ]
    assert [[w["word"] for w in s["words"]] for s in doc["segments"]] == expected  # one per word of the sentence
    times = [(w["start_time"], w["end_time"]) for s in doc["segments"] for w in s["words"]]
    flat = [t for pair in times for t in pair]
    assert flat == sorted(flat) and all(end > start for start, end in times)  # monotonic
    for s in doc["segments"]:
        assert s["start_s"] <= s["words"][0]["start_time"] and s["words"][-1]["end_time"] <= s["end_s"]
    assert doc["segments"][-1]["end_s"] == samples / RATE  # inside the audio
    words = post(base + "/v1/tts/captioned", json={**body, "format": "vtt", "caption_unit": "word"}).text
    assert words.startswith("WEBVTT") and words.count("-->") == len(times)
    assert doc["captions"].count("-->") == 2  # sentence cues unless asked for words


def test_concurrent_requests_batch_and_sound_as_they_do_alone(live, batches):
    """While the first request's batch is held, three more arrive; they run together in the next batch, and
    every request's audio is its audio alone (lengths exact; waveform within the model's batch bound, which
    int16 rounding may turn into 1)."""
    base, engine, _ = live
    texts = ["你好。", "世界和平。", "再见。", "早上好。"]
    alone = [pcm(tts(base, text=t, voice="zm_yunjian", seed=10 + i)) for i, t in enumerate(texts)]
    batches.clear()
    batches.gate = threading.Semaphore(0)
    results: dict[int, np.ndarray] = {}

    def post(i: int) -> None:
        results[i] = pcm(tts(base, text=texts[i], voice="zm_yunjian", seed=10 + i))

    first = threading.Thread(target=post, args=(0,))
    first.start()
    assert wait_until(lambda: engine.stats().num_running == 1, 30)
    others = [threading.Thread(target=post, args=(i,)) for i in (1, 2, 3)]
    for t in others:
        t.start()
    assert wait_until(lambda: len(engine._collectors) == 4, 30)
    batches.gate.release(10)
    for t in (first, *others):
        t.join(TIMEOUT)
    assert [len(b) for b in batches] == [1, 3]
    for i in range(4):
        assert len(results[i]) == len(alone[i]) and np.abs(results[i] - alone[i]).max() <= 1


def test_a_dialogue_of_kokoro_voices(live):
    base = live[0]
    turns = [{"text": ONE, "voice": "zf_xiaobei", "seed": 1}, {"text": ONE, "voice": "zm_yunjian", "seed": 1}]
    r = post(base + "/v1/dialogue", json={"turns": turns, "format": "pcm", "stream": False, "pause_ms": 100})
    assert r.status_code == 200, r.text
    a, b = (tts(base, text=ONE, voice=v, seed=1) for v in ("zf_xiaobei", "zm_yunjian"))
    assert len(r.content) == len(a) + len(b) + 2 * RATE // 10


def test_websocket_segment_events_carry_their_words(live):
    from websockets.sync.client import connect

    from .conftest import ws_url

    with connect(ws_url(live[0]), open_timeout=10, close_timeout=5) as ws:
        start = {"type": "start", "format": "pcm", "timestamps": True, "voice": "zf_xiaobei", "seed": 8}
        ws.send(json.dumps(start))
        ws.send(json.dumps({"type": "text", "text": TWO}))
        ws.send(json.dumps({"type": "end"}))
        segments, samples = [], 0
        while True:
            event = json.loads(ws.recv(timeout=TIMEOUT))
            if event["type"] == "chunk" and event["bytes"]:
                samples += len(ws.recv(timeout=TIMEOUT)) // 2
            elif event["type"] == "segment":
                assert round(event["end_s"] * RATE) <= samples  # after its audio
                segments.append(event)
            elif event["type"] in ("end", "error"):
                assert event["type"] == "end", event
                break
    assert [[w["word"] for w in s["words"]] for s in segments] == [
        ["今天天气", "很", "好"],
        ["我们", "去", "公园", "散步", "吧"],
    ]
    assert segments[-1]["words"][-1]["end_time"] <= samples / RATE


def test_ssml_rate_breaks_and_voices(live):
    base = live[0]
    plain = tts(base, text="你好。世界，和平。", voice="zf_xiaobei", seed=9)
    ssml = '<speak>你好<break time="500ms"/>世界<break time="100ms"/>和平。</speak>'
    assert tts(base, text=ssml, voice="zf_xiaobei", seed=9) == plain
    fast = tts(base, text=f'<speak><prosody rate="x-fast">{ssml[7:-8]}</prosody></speak>', voice="zf_xiaobei", seed=9)
    assert len(fast) < 0.75 * len(plain)
    two = tts(base, text='<speak>你好。<voice name="zm_yunjian">世界。</voice></speak>', voice="zf_xiaobei", seed=9)
    assert len(two) > 0


def test_wyoming_speaks_a_kokoro_voice_as_http_does(live):
    import asyncio

    from wyoming.audio import AudioChunk
    from wyoming.client import AsyncTcpClient
    from wyoming.info import Describe, Info
    from wyoming.tts import Synthesize, SynthesizeVoice

    async def speak():
        async with AsyncTcpClient("127.0.0.1", live[2], connect_timeout=10, read_timeout=TIMEOUT) as c:
            await c.write_event(Describe().event())
            info = Info.from_event(await c.read_event())
            await c.write_event(Synthesize(text=ONE, voice=SynthesizeVoice(name="zm_yunjian")).event())
            audio = b""
            while (event := await c.read_event()) is not None and event.type != "audio-stop":
                assert event.type != "error", event
                if AudioChunk.is_type(event.type):
                    audio += AudioChunk.from_event(event).audio
            return info, audio

    info, audio = asyncio.run(speak())
    program = info.tts[0]
    assert program.name == "kokoro" and program.description == "Kokoro-82M text to speech, 24000 Hz (chattts-serve)"
    voices = {v.name: v for v in program.voices}
    assert (voices["zm_yunjian"].languages, voices["af_heart"].languages) == (["zh-CN"], ["en-US"])
    assert voices["zm_yunjian"].description == "zm_yunjian (Mandarin Chinese, male)"
    heard = pcm(audio)
    http = pcm(tts(live[0], text=ONE, voice="zm_yunjian"))  # unseeded: another draw of the noise
    assert len(heard) == len(http) > 0  # durations do not depend on the noise


@pytest.fixture(scope="module")
def cached_bf16(tmp_path_factory):
    """A second server: the result cache on, the decoder's convolutions in bf16 (``--audio-dtype bf16``)."""
    tmp = tmp_path_factory.mktemp("kokoro-bf16")
    root = models.get("kokoro").write_random(tmp / "kokoro", "tiny")
    config = app_config(root, tmp, port=free_port(), cache_mb=8, audio_dtype="bf16")
    app = create_app(config)
    with serving(app, config) as srv:
        yield srv.base, app.state.engine


def test_a_seeded_request_is_cached_and_bf16_reaches_the_served_model(cached_bf16, live):
    base, engine = cached_bf16
    model = engine.engine.family_model
    assert model.model.decoder_dtype == torch.bfloat16
    calls = []
    run = model.synthesize
    model.synthesize = lambda batch: calls.append(len(batch)) or run(batch)
    try:
        body = {"text": ONE, "voice": "zf_xiaobei", "format": "wav", "seed": 4, "stream": False}
        first, again = post(base + "/v1/tts", json=body), post(base + "/v1/tts", json=body)
    finally:
        model.synthesize = run
    assert (first.headers["X-Cache"], again.headers["X-Cache"]) == ("miss", "hit")
    assert first.content == again.content and calls == [1]  # the hit never reached the model
    fp32 = post(live[0] + "/v1/tts", json=body)  # the same checkpoint (seed 0) in fp32: close, not the same bits
    assert fp32.status_code == 200 and fp32.content != first.content and len(fp32.content) == len(first.content)
