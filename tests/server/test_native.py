"""The native API: ``POST /v1/tts`` (streamed and whole, every parameter, error shapes); the WebSocket is
in test_websocket.py."""

from __future__ import annotations

import struct
import time

import pytest

from .conftest import (
    SR,
    check_openai_error,
    check_streamed_wav,
    decode_audio,
    expected_samples,
)

TEXT = "今天天气真不错。"
TOKENS = 40
EXPECTED = expected_samples(TOKENS)
FIXED = {"seed": 1, "refine_text": False, "min_new_tokens": TOKENS, "max_new_tokens": TOKENS}


def test_tts_streams_wav_by_default(http):
    r = http.post("/v1/tts", json={"text": TEXT, **FIXED})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("audio/wav")
    assert "content-length" not in r.headers  # streamed (chunked)
    check_streamed_wav(r.content, EXPECTED)
    assert struct.unpack_from("<I", r.content, 40)[0] == 0xFFFFFFFF  # open-ended sizes while streaming
    assert struct.unpack_from("<I", r.content, 4)[0] == 0xFFFFFFFF


def test_tts_whole_wav_has_exact_header(http):
    whole = http.post("/v1/tts", json={"text": TEXT, "stream": False, **FIXED})
    assert whole.status_code == 200
    assert whole.headers["content-type"].startswith("audio/wav")
    data = whole.content
    assert int(whole.headers["content-length"]) == len(data) == 44 + 2 * EXPECTED
    assert data[:4] == b"RIFF" and data[8:16] == b"WAVEfmt " and data[36:40] == b"data"
    assert struct.unpack_from("<I", data, 4)[0] == 36 + 2 * EXPECTED
    assert struct.unpack_from("<I", data, 40)[0] == 2 * EXPECTED
    assert struct.unpack_from("<I", data, 24)[0] == SR
    samples, rate = decode_audio(data, "wav")
    assert rate == SR and len(samples) == EXPECTED
    streamed = http.post("/v1/tts", json={"text": TEXT, "stream": True, **FIXED}).content
    assert streamed[44:] == data[44:]  # same audio, only the header differs


@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac", "flac", "pcm"])
def test_tts_formats(http, fmt):
    for stream in (True, False):
        r = http.post("/v1/tts", json={"text": TEXT, "format": fmt, "stream": stream, **FIXED})
        assert r.status_code == 200, r.text
        samples, rate = decode_audio(r.content, fmt)
        assert rate in (SR, 48000)
        n24 = len(samples) * SR // rate
        assert EXPECTED <= n24 <= EXPECTED + 1105 + 1152  # see test_openai for the codec priming


def test_tts_every_parameter_accepted(http):
    body = {
        "text": TEXT,
        "format": "pcm",
        "seed": 7,
        "temperature": 0.4,
        "top_p": 0.8,
        "top_k": 15,
        "repetition_penalty": 1.1,
        "min_new_tokens": TOKENS,
        "max_new_tokens": TOKENS,
        "prompt": "[speed_3]",
        "refine_text": True,
        "refine_prompt": "[oral_2][laugh_0][break_6]",
        "refine_temperature": 0.6,
        "refine_top_p": 0.5,
        "refine_top_k": 10,
        "refine_max_new_tokens": 16,
        "do_text_normalization": True,
        "do_homophone_replacement": True,
        "lang": "zh",
        "split_text": False,
        "voice": "alloy",
        "stream": True,
        "chunking": {"first_chunk": 4, "max_chunk": 16, "left_context": 8, "lookahead": 4, "crossfade": 128},
    }
    r = http.post("/v1/tts", json=body)
    assert r.status_code == 200, r.text
    assert len(r.content) == 2 * EXPECTED
    english = {
        "text": "Hello there, 42 apples.",
        "format": "pcm",
        **FIXED,
        "do_text_normalization": False,
        "do_homophone_replacement": False,
        "lang": "en",
        "split_text": True,
        "stream": False,
    }
    r = http.post("/v1/tts", json=english)
    assert r.status_code == 200, r.text
    assert len(r.content) == 2 * EXPECTED


def test_split_text(http):
    two = "今天天气真不错。我们去公园吧。"
    split = http.post("/v1/tts", json={"text": two, "format": "pcm", **FIXED, "split_text": True})
    whole = http.post("/v1/tts", json={"text": two, "format": "pcm", **FIXED, "split_text": False})
    assert len(split.content) == 2 * expected_samples(TOKENS, segments=2)
    assert len(whole.content) == 2 * EXPECTED


def test_split_text_keeps_the_first_sentence_voice(http):
    """Several sentences: by default the first is spoken alone first and its audio is every sentence's
    voice sample (the reference's voice step); first_sentence_voice=false turns it off. Same length
    either way, different speech; a single sentence is unaffected."""
    two = "今天天气真不错。我们去公园吧。"
    body = {"text": two, "format": "pcm", **FIXED, "stream": False}
    voiced = http.post("/v1/tts", json=body)
    plain = http.post("/v1/tts", json={**body, "first_sentence_voice": False})
    assert voiced.status_code == plain.status_code == 200
    assert len(voiced.content) == len(plain.content) == 2 * expected_samples(TOKENS, segments=2)
    assert voiced.content != plain.content
    one = {"text": TEXT, "format": "pcm", **FIXED, "stream": False}
    assert (
        http.post("/v1/tts", json=one).content
        == http.post("/v1/tts", json={**one, "first_sentence_voice": False}).content
    )


def _stream_chunks(http, body) -> tuple[list[bytes], list[float]]:
    chunks, times = [], []
    t0 = time.monotonic()
    with http.stream("POST", "/v1/tts", json=body) as r:
        assert r.status_code == 200
        for chunk in r.iter_raw():
            if chunk:
                chunks.append(chunk)
                times.append(time.monotonic() - t0)
    return chunks, times


def test_tts_pcm_arrives_in_several_chunks(http):
    tokens = 300
    body = {
        "text": TEXT,
        "format": "pcm",
        "seed": 1,
        "refine_text": False,
        "min_new_tokens": tokens,
        "max_new_tokens": tokens,
    }
    chunks, times = _stream_chunks(http, body)
    assert len(b"".join(chunks)) == 2 * expected_samples(tokens)
    # the default policy emits 12, 24, 48, 96, 96, ... steps: at least 4 pieces for 300 steps
    assert len(chunks) >= 3, [len(c) for c in chunks]
    assert times[0] < times[-1]
    # a smaller chunking policy gives more (smaller) chunks and still exactly the same number of samples
    small = {**body, "chunking": {"first_chunk": 4, "max_chunk": 8, "left_context": 4, "lookahead": 2, "crossfade": 0}}
    chunks2, _ = _stream_chunks(http, small)
    assert len(b"".join(chunks2)) == 2 * expected_samples(tokens)
    assert len(chunks2) > len(chunks)


def test_tts_error_shapes(http):
    check_openai_error(http.post("/v1/tts", json={"text": ""}), 400)
    err = check_openai_error(http.post("/v1/tts", json={"text": TEXT, "chunking": {"lookahead": 0}}), 400)
    assert "lookahead" in err["message"]


# ------------------------------------------------------------------------------ SSML and the lexicon


def _pcm(http, text: str, **extra) -> bytes:
    r = http.post("/v1/tts", json={"text": text, "format": "pcm", "stream": False, **FIXED, **extra})
    assert r.status_code == 200, r.text
    return r.content


def test_ssml_is_the_audio_of_its_plain_text(http):
    ssml = '<speak><prosody rate="slow">今天<break time="500ms"/>天气真不错。</prosody></speak>'
    audio = _pcm(http, ssml)
    assert audio == _pcm(http, "今天[lbreak]天气真不错。", prompt="[speed_4]")
    assert audio != _pcm(http, TEXT)


def test_the_lexicon_is_the_audio_of_its_homophones(http):
    from chattts_serve.text.lexicon import homophone

    respelled = f"今天天气真不{homophone('cuo4')}。"
    audio = _pcm(http, TEXT, lexicon={"错": "cuo4"})
    assert audio == _pcm(http, respelled) and audio != _pcm(http, TEXT, lexicon={"错": "好"})


@pytest.mark.parametrize(
    "body, words",
    [
        ({"text": "<speak>今天\n  <voice name='nobody'>好</voice></speak>"}, ["<voice>", "line 2, column 3", "nobody"]),
        ({"text": "<speak>今天<emphasis>好</emphasis></speak>"}, ["<emphasis>", "line 1, column 10"]),
        ({"text": '<speak>今天<break time="1s"></speak>'}, ["mismatched tag", "<break>", "line 1, column 29"]),
        ({"text": TEXT, "lexicon": {"乐": "le4"}}, ["lexicon", "le4"]),
        ({"text": TEXT, "lexicon": {f"w{i}": "x" for i in range(1001)}}, ["lexicon"]),
    ],
)
def test_bad_ssml_and_lexicons_are_400s_naming_the_fault(http, body, words):
    err = check_openai_error(http.post("/v1/tts", json={**FIXED, **body}), 400)
    for word in words:
        assert word in err["message"], err


def test_the_servers_lexicon_and_the_requests(tiny_ckpt, tmp_path):
    """``--lexicon FILE`` applies to every request; a request's own entries win over it."""
    import httpx

    from chattts_serve.text.lexicon import homophone

    from .conftest import HTTP_TIMEOUT, running_server

    words = tmp_path / "words.tsv"
    words.write_text("# the server's words\n错\tcuo4\n", encoding="utf-8")
    with running_server(tiny_ckpt, tmp_path, "--lexicon", str(words), in_process=True) as base:
        with httpx.Client(base_url=base, timeout=HTTP_TIMEOUT) as c:
            served = _pcm(c, TEXT)
            assert served == _pcm(c, f"今天天气真不{homophone('cuo4')}。", lexicon={"错": "错"})
            assert _pcm(c, TEXT, lexicon={"错": "好"}) == _pcm(c, "今天天气真不好。")


def test_an_expanding_lexicon_is_refused_at_the_input_bound_and_the_server_stays_free(server):
    """4 KB of text whose lexicon makes it a megabyte: a 400 naming ``max_input_chars`` (which holds after the
    expansion), refused after about the bound's worth of work, so a /health probe sent meanwhile is answered
    at once (each such request used to cost seconds of CPU and stall the event loop for as long)."""
    import threading

    import httpx

    from .conftest import HTTP_TIMEOUT

    bombs = [
        {"text": "a" * 4000, "lexicon": {"a": "啊" * 256}},
        {"text": ("a" * 8 + "。") * 250, "lexicon": {"a": "啊" * 255}},  # was a 200 after 25 s
        {"text": "<speak>" + "a" * 4000 + "</speak>", "lexicon": {"a": "啊" * 256}},
    ]
    answers: list[httpx.Response] = []

    def send() -> None:
        with httpx.Client(base_url=server, timeout=HTTP_TIMEOUT) as c:
            for body in bombs * 2:
                answers.append(c.post("/v1/tts", json={**FIXED, **body}))

    senders = [threading.Thread(target=send) for _ in range(2)]
    for t in senders:
        t.start()
    lags = []
    with httpx.Client(base_url=server, timeout=HTTP_TIMEOUT) as probe:
        while any(t.is_alive() for t in senders) or not lags:
            t0 = time.monotonic()
            assert probe.get("/health").status_code == 200
            lags.append(time.monotonic() - t0)
    for t in senders:
        t.join(HTTP_TIMEOUT)
    assert len(answers) == 12
    for r in answers:
        err = check_openai_error(r, 400)
        assert err["code"] == "input_too_long" and "the limit is 4096" in err["message"], err
    assert max(lags) < 1.0, lags  # generous: the loop is free while the requests are refused
    # The same on the OpenAI route and in a dialogue's turn (named).
    with httpx.Client(base_url=server, timeout=HTTP_TIMEOUT) as c:
        speech = {"model": "tts-1", "voice": "alloy", "input": "a" * 4000, "lexicon": {"a": "啊" * 256}}
        err = check_openai_error(c.post("/v1/audio/speech", json=speech), 400)
        assert err["code"] == "input_too_long", err
        turns = [{"voice": "alloy", "text": "你好。"}, {"voice": "nova", **bombs[0]}]
        err = check_openai_error(c.post("/v1/dialogue", json={"turns": turns}), 400)
        assert err["code"] == "input_too_long" and err["message"].startswith("turn 1: "), err


def test_ssml_with_an_xml_declaration_is_read_as_ssml(http):
    """A document as generators write it (declaration, W3C namespace) is SSML, not text read aloud."""
    doc = (
        '\ufeff<?xml version="1.0" encoding="UTF-8"?>\n<!-- generated -->\n<speak version="1.0" '
        'xmlns="http://www.w3.org/2001/10/synthesis" xml:lang="zh-CN">你好<break time="500ms"/>再见</speak>'
    )
    r = http.post("/v1/tts/captioned", json={"text": doc, **FIXED})
    assert r.status_code == 200, r.text
    assert [s["text"] for s in r.json()["segments"]] == ["你好再见"]  # no "xml version", no "speak"
    assert _pcm(http, doc) == _pcm(http, "你好[lbreak]再见")
    bomb = (
        '<?xml version="1.0"?><!DOCTYPE l [<!ENTITY a "aaaaaaaaaa">'
        + "".join(f'<!ENTITY {chr(98 + i)} "{("&" + chr(97 + i) + ";") * 10}">' for i in range(8))
        + "]><speak>&i;</speak>"
    )
    err = check_openai_error(http.post("/v1/tts", json={"text": bomb, **FIXED}), 400)
    assert "DOCTYPE" in err["message"]


# ------------------------------------------------------------------------------ WebSocket limits and failures
# An app in this process (uvicorn on 127.0.0.1 in a thread), so a test can make its engine stall or fail at a
# chosen step, change its config, and count the messages the handler has read.


@pytest.mark.parametrize(("fmt", "rate"), [("wav", 16000), ("mulaw", None), ("alaw", 16000), ("pcm", 44100)])
def test_tts_sample_rate_streamed_and_whole(http, fmt, rate):
    """``sample_rate`` in the native body: streamed and whole give the same audio (a whole wav has exact sizes
    at the new rate); mulaw and alaw default to 8 kHz, one byte a sample."""
    body = {"text": TEXT, "format": fmt, **FIXED, **({"sample_rate": rate} if rate else {})}
    streamed = http.post("/v1/tts", json=body)
    whole = http.post("/v1/tts", json={**body, "stream": False})
    assert streamed.status_code == whole.status_code == 200, streamed.text
    out_rate = rate or 8000
    n = round(EXPECTED * out_rate / SR)
    width = 1 if fmt in ("mulaw", "alaw") else 2
    if fmt == "wav":
        data = whole.content
        assert struct.unpack_from("<IIIH", data, 24)[:2] == (out_rate, 2 * out_rate)
        assert (
            abs(struct.unpack_from("<I", data, 40)[0] - 2 * n) <= 2
            and len(data) == 44 + struct.unpack_from("<I", data, 40)[0]
        )
        assert streamed.content[44:] == data[44:]
    else:
        assert abs(len(whole.content) - width * n) <= width and streamed.content == whole.content


def test_tts_sample_rate_refused_for_lossy_formats(http):
    r = http.post("/v1/tts", json={"text": TEXT, "format": "aac", "sample_rate": 8000, **FIXED})
    error = check_openai_error(r, 400)
    assert error["param"] == "sample_rate" and "aac is always encoded at 24000 Hz" in error["message"]


def test_openapi_lists_the_telephony_formats(http):
    doc = http.get("/openapi.json").json()
    schemas = doc["components"]["schemas"]
    for name, field in (("TTSRequest", "format"), ("SpeechRequest", "response_format")):
        assert {"mulaw", "alaw"} <= set(schemas[name]["properties"][field]["enum"])
        rate = schemas[name]["properties"]["sample_rate"]["anyOf"][0]
        assert (rate["minimum"], rate["maximum"]) == (8000, 48000)
    content = doc["paths"]["/v1/tts"]["post"]["responses"]["200"]["content"]
    assert "audio/PCMU" in content and "audio/PCMA" in content
