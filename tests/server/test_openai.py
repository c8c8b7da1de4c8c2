"""The OpenAI-compatible API through the official ``openai`` SDK against a real server process."""

from __future__ import annotations

import base64
import json
import struct

import numpy as np
import pytest
from openai import OpenAI

from .conftest import (
    SR,
    check_one_ogg_opus_stream,
    check_streamed_wav,
    decode_audio,
    expected_samples,
)

FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")
TOKENS = 40
EXPECTED = expected_samples(TOKENS)  # 512 * 40 - 256 = 20224 samples (0.8427 s)
TEXT = "今天天气真不错。"
FIXED = {"seed": 1, "min_new_tokens": TOKENS, "max_new_tokens": TOKENS, "refine_text": False}

# Codec properties at 24 kHz: (priming samples the decoder does not trim, samples per codec frame).
# mp3: LAME's encoder delay (576) + the decoder delay (529); the stream has no LAME/Xing gapless tag
# (the muxer cannot seek back to write it), so nothing is trimmed. MPEG-2 layer III frames are 576.
# aac: ADTS has no edit list, so the 1024-sample AAC priming stays in the decoded output.
# opus: Ogg Opus pre-skip is applied by the decoder (exact); 20 ms frames = 480 samples at 24 kHz.
CODEC = {"mp3": (1105, 576), "aac": (1024, 1024), "opus": (0, 480), "flac": (0, 0), "wav": (0, 0), "pcm": (0, 0)}


@pytest.fixture(scope="module")
def client(server):
    with OpenAI(base_url=f"{server}/v1", api_key="x", timeout=60, max_retries=0) as c:
        yield c


def _speech(client, fmt: str, **extra) -> bytes:
    resp = client.audio.speech.create(
        model="tts-1", voice="alloy", input=TEXT, response_format=fmt, extra_body={**FIXED, **extra}
    )
    return resp.content


def check_body(data: bytes, fmt: str) -> int:
    """Decode and check rate and duration; returns the decoded sample count (at the output rate)."""
    samples, rate = decode_audio(data, fmt)
    n = len(samples)
    if fmt == "opus":
        assert rate == 48000  # libopus always decodes at 48 kHz ...
        assert check_one_ogg_opus_stream(data) == SR  # ... the stream says the input was 24 kHz
        assert n % 2 == 0
        n24 = n // 2
    else:
        assert rate == SR
        n24 = n
    priming, frame = CODEC[fmt]
    assert abs(n24 - priming - EXPECTED) <= frame, f"{fmt}: decoded {n24} samples, expected {EXPECTED}+{priming}"
    if fmt == "flac":
        assert data[:4] == b"fLaC" and data.count(b"fLaC") == 1
    if fmt == "wav":
        check_streamed_wav(data, EXPECTED)
    if fmt == "mp3":
        assert data.count(b"ID3") <= 1
    return n


def test_models_list(client):
    ids = [m.id for m in client.models.list()]
    assert "tts-1" in ids and "tts-1-hd" in ids and "chattts" in ids


@pytest.mark.parametrize("fmt", FORMATS)
def test_speech_every_format(client, fmt):
    data = _speech(client, fmt)
    check_body(data, fmt)


def test_lossless_formats_match_pcm(client):
    pcm, _ = decode_audio(_speech(client, "pcm"), "pcm")
    assert len(pcm) == EXPECTED
    wav, _ = decode_audio(_speech(client, "wav"), "wav")
    flac, _ = decode_audio(_speech(client, "flac"), "flac")
    np.testing.assert_array_equal(wav, pcm)
    np.testing.assert_array_equal(flac, pcm)
    # a lossy format decodes to finite, non-silent audio of a similar level
    opus, _ = decode_audio(_speech(client, "opus"), "opus")
    assert np.isfinite(opus).all()
    rms_opus, rms_pcm = np.sqrt(np.mean(opus**2)), np.sqrt(np.mean((pcm / 32768.0) ** 2))
    assert 0.3 < rms_opus / rms_pcm < 3


@pytest.mark.parametrize("fmt", FORMATS)
def test_streaming_response_every_format(client, fmt):
    with client.audio.speech.with_streaming_response.create(
        model="tts-1", voice="alloy", input=TEXT, response_format=fmt, extra_body=FIXED
    ) as resp:
        assert resp.http_response.status_code == 200
        chunks = [c for c in resp.iter_bytes() if c]
    data = b"".join(chunks)
    assert chunks
    check_body(data, fmt)  # one valid stream: duration would double if two streams were concatenated
    if fmt not in ("opus",):  # Ogg serial numbers are random per stream; everything else is byte-exact
        assert data == _speech(client, fmt)


@pytest.mark.parametrize("fmt", ["wav", "opus"])
def test_sse_stream_format(client, fmt):
    with client.audio.speech.with_streaming_response.create(
        model="tts-1", voice="alloy", input=TEXT, response_format=fmt, stream_format="sse", extra_body=FIXED
    ) as resp:
        assert resp.http_response.headers["content-type"].startswith("text/event-stream")
        raw = resp.read().decode()
    events = []
    for block in raw.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block[:100]
        events.append(json.loads(block[len("data: ") :]))
    assert len(events) >= 2
    assert all(e["type"] == "speech.audio.delta" for e in events[:-1])
    assert events[-1]["type"] == "speech.audio.done"
    assert "usage" in events[-1]
    audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    check_body(audio, fmt)


def test_sse_via_extra_body(client):
    with client.audio.speech.with_streaming_response.create(
        model="tts-1", voice="alloy", input=TEXT, response_format="pcm", extra_body={**FIXED, "stream_format": "sse"}
    ) as resp:
        raw = resp.read().decode()
    events = [json.loads(b[6:]) for b in raw.split("\n\n") if b.strip()]
    audio = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    assert events[-1]["type"] == "speech.audio.done"
    assert len(audio) == 2 * EXPECTED
    # Real usage: the text's tokens in (one per CJK character and the full stop, as the tokenizer
    # splits them), the audio tokens out (one per 512 samples, fixed to TOKENS here).
    assert events[-1]["usage"] == {
        "input_tokens": len(TEXT),
        "output_tokens": TOKENS,
        "total_tokens": len(TEXT) + TOKENS,
    }


def test_chattts_extra_fields_accepted(client):
    data = _speech(
        client,
        "pcm",
        temperature=0.5,
        top_p=0.8,
        top_k=10,
        repetition_penalty=1.1,
        refine_text=True,
        refine_prompt="[oral_2][laugh_0][break_6]",
        refine_temperature=0.5,
        refine_top_p=0.6,
        refine_top_k=5,
        refine_max_new_tokens=16,
        do_text_normalization=True,
        do_homophone_replacement=True,
        lang="zh",
        split_text=False,
    )
    assert len(data) == 2 * EXPECTED
    resp = client.audio.speech.create(
        model="tts-1-hd",
        voice="alloy",
        input=TEXT,
        response_format="pcm",
        speed=1.0,
        instructions="Speak cheerfully.",
        extra_body=FIXED,
    )
    assert len(resp.content) == 2 * EXPECTED


def test_same_seed_same_bytes(client):
    a, b = _speech(client, "wav"), _speech(client, "wav")
    assert a == b
    c = _speech(client, "wav", seed=2)
    assert len(c) == len(a) and c != a


def test_speed_maps_to_prompt(client):
    slow = client.audio.speech.create(
        model="tts-1", voice="alloy", input=TEXT, response_format="pcm", speed=0.5, extra_body=FIXED
    ).content
    fast = client.audio.speech.create(
        model="tts-1", voice="alloy", input=TEXT, response_format="pcm", speed=2.0, extra_body=FIXED
    ).content
    assert len(slow) == len(fast) == 2 * EXPECTED  # the token count is pinned; the prompt differs
    assert slow != fast
    # speed 1.0 is the default prompt, [speed_5]
    normal = _speech(client, "pcm")
    assert normal == _speech(client, "pcm", prompt="[speed_5]")
    assert normal not in (slow, fast)


def test_sdk_raises_on_bad_request(client):
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        client.audio.speech.create(model="tts-1", voice="no-such-voice", input=TEXT, extra_body=FIXED)
    assert info.value.status_code == 400
    assert info.value.body["code"] == "unknown_voice"


def test_markdown_cleanup_through_extra_body(client):
    """An LLM's markdown answer with ``text_cleanup: markdown`` is the same audio as the text a person reads."""
    markdown = "**今天**天气[真不错](https://example.com/weather)。🌞"

    def speech(text: str, **extra) -> bytes:
        resp = client.audio.speech.create(
            model="tts-1", voice="alloy", input=text, response_format="pcm", extra_body={**FIXED, **extra}
        )
        return resp.content

    cleaned = speech(markdown, text_cleanup="markdown")
    assert cleaned == speech("今天天气真不错。")
    assert cleaned != speech(markdown)  # without it the link target and marks are spoken


def _g711(data: bytes, fmt: str, rate: int = 8000) -> np.ndarray:
    """Headerless G.711 decoded by FFmpeg (it needs the format's name and rate)."""
    import io

    import av

    with av.open(io.BytesIO(data), format=fmt, options={"sample_rate": str(rate)}) as container:
        return np.concatenate([f.to_ndarray().reshape(-1) for f in container.decode(audio=0)])


@pytest.mark.parametrize("fmt", ["mulaw", "alaw"])
def test_telephony_formats(client, fmt):
    """G.711 at 8 kHz, one byte a sample and no header, streamed or whole alike; it is the 8 kHz resampling
    of the same audio the pcm format carries (within G.711's companded 8-bit steps)."""
    data = _speech(client, fmt)
    assert abs(len(data) - EXPECTED / 3) <= 1
    with client.audio.speech.with_streaming_response.create(
        model="tts-1", voice="alloy", input=TEXT, response_format=fmt, extra_body=FIXED
    ) as resp:
        assert resp.http_response.headers["content-type"] == ("audio/PCMU" if fmt == "mulaw" else "audio/PCMA")
        assert resp.read() == data
    from chattts_serve.audio.resample import resample

    pcm = np.frombuffer(_speech(client, "pcm"), "<i2").astype(np.float32) / 32767
    reference = resample(pcm, 8000, 24000)
    decoded = _g711(data, fmt).astype(np.float32) / 32768
    assert len(decoded) == len(reference)
    assert np.abs(decoded - reference).max() < 0.02 + np.abs(reference).max() / 16  # G.711's steps grow with level


@pytest.mark.parametrize(("fmt", "rate"), [("pcm", 16000), ("wav", 48000), ("flac", 44100), ("mulaw", 16000)])
def test_sample_rate_in_extra_body(client, fmt, rate):
    """``sample_rate`` through the SDK's ``extra_body``: the audio is resampled as it streams; the duration
    stays the same and the containers say the new rate."""
    data = _speech(client, fmt, sample_rate=rate)
    if fmt == "mulaw":
        samples = _g711(data, fmt, rate)
    else:
        samples, got = decode_audio(data, fmt) if fmt != "pcm" else (np.frombuffer(data, "<i2"), rate)
        assert got == rate
    assert abs(len(samples) - EXPECTED * rate / SR) <= 1
    if fmt == "wav":  # an open-ended header that says the new rate
        assert struct.unpack_from("<II", data, 24) == (rate, 2 * rate) and data[40:44] == b"\xff" * 4


def test_sample_rate_in_sse(client):
    with client.audio.speech.with_streaming_response.create(
        model="tts-1",
        voice="alloy",
        input=TEXT,
        response_format="mulaw",
        stream_format="sse",
        extra_body={**FIXED, "sample_rate": 8000},
    ) as resp:
        raw = resp.read().decode()
    events = [json.loads(b[6:]) for b in raw.split("\n\n") if b.strip()]
    audio = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    assert audio == _speech(client, "mulaw")


@pytest.mark.parametrize(
    ("fmt", "rate", "why"),
    [
        ("mp3", 16000, "sample_rate applies to pcm, wav, flac, mulaw, alaw; mp3 is always encoded at 24000"),
        ("opus", 48000, "opus is always encoded at 24000"),
        ("pcm", 96000, "less than or equal to 48000"),
        ("wav", 4000, "greater than or equal to 8000"),
    ],
)
def test_sample_rate_refused_where_it_cannot_apply(client, fmt, rate, why):
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        _speech(client, fmt, sample_rate=rate)
    error = info.value.body
    assert why in error["message"] and error["param"] == "sample_rate"
    assert _speech(client, "mp3", sample_rate=24000)  # the rate it has anyway is no error


def test_sdk_speaks_a_voice_blend(client):
    """Kokoro-FastAPI's blend syntax in the SDK's plain ``voice`` field: built-in names with weights."""
    import openai

    def speech(voice: str) -> bytes:
        resp = client.audio.speech.create(
            model="tts-1", voice=voice, input=TEXT, response_format="pcm", extra_body=FIXED
        )
        return resp.content

    mixed = speech("alloy(2)+nova(1)")
    assert len(mixed) == 2 * EXPECTED
    assert speech("alloy(2)+nova(1)") == mixed  # same seed, same blend: same bytes
    assert mixed not in (speech("alloy"), speech("nova"), speech("alloy+nova"))
    with pytest.raises(openai.BadRequestError) as info:
        speech("alloy(2)+nova(0)")
    assert info.value.body["code"] == "invalid_blend" and "nova(0)" in info.value.body["message"]


def test_ssml_and_a_lexicon_through_the_sdk(client):
    """``input`` may be SSML; the lexicon goes in ``extra_body``; bad SSML is a 400 naming tag and place."""
    import openai

    from chattts_serve.text.lexicon import homophone

    def speech(text: str, **extra) -> bytes:
        resp = client.audio.speech.create(
            model="tts-1", voice="alloy", input=text, response_format="pcm", extra_body={**FIXED, **extra}
        )
        return resp.content

    ssml = '<speak>今天<break strength="strong"/>天气<sub alias="真不错">挺好</sub>。</speak>'
    assert speech(ssml) == speech("今天[lbreak]天气真不错。")
    assert speech(ssml, lexicon={"天气": "tian1 qi4"}) == speech(
        f"今天[lbreak]{homophone('tian1')}{homophone('qi4')}真不错。"
    )
    # A prosody rate in the SSML wins over the request's speed.
    fast = client.audio.speech.create(
        model="tts-1",
        voice="alloy",
        input=f'<speak><prosody rate="x-fast">{TEXT}</prosody></speak>',
        response_format="pcm",
        speed=0.5,
        extra_body=FIXED,
    ).content
    assert fast == speech(TEXT, prompt="[speed_8]")
    with pytest.raises(openai.BadRequestError) as info:
        speech("<speak>今天<audio src='a.wav'/>天气。</speak>")
    assert info.value.status_code == 400
    assert "<audio> at line 1, column 10" in info.value.body["message"]


def test_models_name_the_family_its_rate_and_capabilities(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["chattts", "tts-1", "tts-1-hd", "gpt-4o-mini-tts"]
    caps = {"streaming": "window", "timestamps": "sentence", "refine": True, "control_tokens": True}
    for m in models:
        assert (m.model_extra["family"], m.model_extra["sample_rate"], m.model_extra["capabilities"]) == (
            "chattts",
            24000,
            caps,
        )
