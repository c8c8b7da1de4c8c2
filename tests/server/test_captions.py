"""Sentence timestamps: the SSE ``speech.segment`` events (through the ``openai`` SDK), the WebSocket's ``segment``
events, ``POST /v1/tts/captioned`` (JSON, srt, vtt), and ``server.captions``' formats on their own."""

from __future__ import annotations

import base64
import json
import re

import numpy as np
import pytest
from openai import OpenAI
from websockets.sync.client import connect

from chattts_serve.engine.outputs import RequestOutput, SegmentResult, SegmentSpan
from chattts_serve.server.captions import SegmentClock, subtitles

from .conftest import SR, check_openai_error, decode_audio, expected_samples, ws_url

TEXT = "今天天气真不错。我们去公园吧。明天见。"
TOKENS = 12
FIXED = {"seed": 3, "refine_text": False, "min_new_tokens": TOKENS, "max_new_tokens": TOKENS}
SRT_TIME = r"\d\d:\d\d:\d\d,\d\d\d"
VTT_TIME = r"\d\d:\d\d:\d\d\.\d\d\d"


def _check_back_to_back(segments: list[dict], total_samples: int) -> None:
    """In order, each starting where the one before ended, the first at 0, the last ending with the audio."""
    assert [s["index"] for s in segments] == list(range(len(segments)))
    assert segments[0]["start_s"] == 0.0
    for before, after in zip(segments, segments[1:], strict=False):
        assert after["start_s"] == before["end_s"]
    assert all(s["end_s"] > s["start_s"] for s in segments)
    assert segments[-1]["end_s"] == total_samples / SR


def _sse_events(server, fmt: str = "pcm", **extra) -> list[dict]:
    with OpenAI(base_url=f"{server}/v1", api_key="x", timeout=60, max_retries=0) as client:
        with client.audio.speech.with_streaming_response.create(
            model="tts-1",
            voice="alloy",
            input=TEXT,
            response_format=fmt,
            stream_format="sse",
            extra_body={**FIXED, "timestamps": True, **extra},
        ) as resp:
            raw = resp.read().decode()
    return [json.loads(block[len("data: ") :]) for block in raw.split("\n\n") if block.strip()]


def test_sse_segment_events_follow_the_audio_of_their_sentence(server):
    events = _sse_events(server)
    assert events[-1]["type"] == "speech.audio.done"
    assert {e["type"] for e in events} == {"speech.audio.delta", "speech.segment", "speech.audio.done"}
    segments, heard = [], 0
    for e in events:
        if e["type"] == "speech.audio.delta":
            heard += len(base64.b64decode(e["audio"])) // 2
        elif e["type"] == "speech.segment":
            assert round(e["end_s"] * SR) <= heard  # the sentence's audio has gone out before its event
            segments.append(e)
    assert len(segments) == 3 and heard == expected_samples(TOKENS, segments=3)
    _check_back_to_back(segments, heard)
    assert [s["text"] for s in segments] == ["今天天气真不错。", "我们去公园吧。", "明天见。"]


def test_sse_segments_with_a_lossy_format_still_end_with_the_audio(server):
    events = _sse_events(server, "mp3")
    segments = [e for e in events if e["type"] == "speech.segment"]
    _check_back_to_back(segments, expected_samples(TOKENS, segments=3))
    assert events[-1]["type"] == "speech.audio.done"


def test_timestamps_need_sse(http):
    body = {"model": "tts-1", "voice": "alloy", "input": TEXT, "timestamps": True, **FIXED}
    error = check_openai_error(http.post("/v1/audio/speech", json=body), 400)
    assert error["param"] == "timestamps"


def test_captioned_json_matches_the_streamed_audio_and_the_sse_segments(server, http):
    r = http.post("/v1/tts/captioned", json={"text": TEXT, "format": "pcm", "captions": "vtt", **FIXED})
    assert r.status_code == 200, r.text
    body = r.json()
    audio = base64.b64decode(body["audio"])
    assert (body["format"], body["sample_rate"]) == ("pcm", SR)
    assert audio == http.post("/v1/tts", json={"text": TEXT, "format": "pcm", **FIXED}).content
    assert body["duration_s"] == len(audio) // 2 / SR
    _check_back_to_back(body["segments"], len(audio) // 2)
    streamed = [e for e in _sse_events(server) if e["type"] == "speech.segment"]
    assert body["segments"] == [{k: v for k, v in e.items() if k != "type"} for e in streamed]
    assert body["captions"].startswith("WEBVTT\n\n") and body["captions"].count("-->") == 3


def test_captioned_wav_decodes_to_the_segments_duration(http):
    r = http.post("/v1/tts/captioned", json={"text": TEXT, "format": "wav", **FIXED})
    body = r.json()
    samples, rate = decode_audio(base64.b64decode(body["audio"]), "wav")
    assert rate == SR and body["captions"] is None
    _check_back_to_back(body["segments"], len(samples))


def test_captioned_srt_and_vtt(http):
    srt = http.post("/v1/tts/captioned", json={"text": TEXT, "format": "srt", **FIXED})
    assert srt.status_code == 200 and srt.headers["content-type"].startswith("application/x-subrip")
    cues = srt.text.strip().split("\n\n")
    assert len(cues) == 3
    ends = []
    for n, cue in enumerate(cues, 1):
        number, timing, text = cue.split("\n")
        assert number == str(n) and text
        assert re.fullmatch(f"({SRT_TIME}) --> ({SRT_TIME})", timing), timing
        start, end = timing.split(" --> ")
        assert start == (ends[-1] if ends else "00:00:00,000")
        ends.append(end)
    vtt = http.post("/v1/tts/captioned", json={"text": TEXT, "format": "vtt", **FIXED})
    assert vtt.headers["content-type"].startswith("text/vtt")
    header, *vtt_cues = vtt.text.strip().split("\n\n")
    assert header == "WEBVTT" and len(vtt_cues) == 3
    for cue, end in zip(vtt_cues, ends, strict=True):
        timing, _ = cue.split("\n")
        assert re.fullmatch(f"{VTT_TIME} --> {VTT_TIME}", timing) and timing.endswith(end.replace(",", "."))


def test_captioned_refuses_a_stream(http):
    r = http.post("/v1/tts/captioned", json={"text": TEXT, "stream": True, **FIXED})
    assert check_openai_error(r, 400)["param"] == "stream"


def test_websocket_segment_events_count_across_parts(server):
    with connect(ws_url(server), open_timeout=10, close_timeout=5) as ws:
        ws.send(json.dumps({"type": "start", "format": "pcm", "timestamps": True, **FIXED}))
        ws.send(json.dumps({"type": "text", "text": "今天天气真不错。我们去"}))
        ws.send(json.dumps({"type": "text", "text": "公园吧。明天见。"}))
        ws.send(json.dumps({"type": "end"}))
        segments, samples = [], 0
        while True:
            event = json.loads(ws.recv(timeout=60))
            if event["type"] == "chunk" and event["bytes"]:
                samples += len(ws.recv(timeout=60)) // 2
            elif event["type"] == "segment":
                assert round(event["end_s"] * SR) <= samples
                segments.append(event)
            elif event["type"] in ("end", "error"):
                assert event["type"] == "end", event
                break
    assert len({s["part"] for s in segments}) >= 2  # the second text message started another part
    _check_back_to_back(segments, samples)
    assert "".join(s["text"] for s in segments) == TEXT


# ------------------------------------------------------------------------------------- server.captions


def _span(index: int, start: int, end: int, text: str = "句子。") -> SegmentSpan:
    return SegmentSpan(index, text, start, end, 24000)


def test_subtitle_times_are_rounded_alike_so_cues_meet():
    spans = [_span(0, 0, 12345), _span(1, 12345, 24000 * 3661 + 1), _span(2, 24000 * 3661 + 1, 24000 * 3661 + 1)]
    srt = subtitles(spans, "srt")
    assert srt == "1\n00:00:00,000 --> 00:00:00,514\n句子。\n\n2\n00:00:00,514 --> 01:01:01,000\n句子。\n"
    vtt = subtitles(spans, "vtt")  # the empty third sentence has no cue
    assert vtt == "WEBVTT\n\n00:00:00.000 --> 00:00:00.514\n句子。\n\n00:00:00.514 --> 01:01:01.000\n句子。\n"


def test_cue_text_is_one_line_and_vtt_escapes_markup():
    spans = [_span(0, 0, 2400, "a\n\nb --> c <i> & d")]
    assert subtitles(spans, "srt").split("\n")[2] == "a b -> c <i> & d"
    assert subtitles(spans, "vtt").split("\n")[3] == "a b -&gt; c &lt;i&gt; &amp; d"  # shows as "a b -> c <i> & d"
    with pytest.raises(ValueError, match="srt, vtt"):
        subtitles(spans, "ass")


def test_segment_clock_places_a_part_in_the_stream_and_reports_each_sentence_once():
    clock = SegmentClock(offset=1000, first_index=4)
    first = RequestOutput("r", np.zeros(10, np.float32), spans=[_span(0, 0, 10)])
    segments = [SegmentResult("x", np.zeros((1, 4), np.int64), "stop", s) for s in (_span(0, 0, 10), _span(1, 10, 30))]
    last = RequestOutput("r", np.zeros(20, np.float32), True, "stop", segments=segments)  # no spans: replayed
    assert clock.feed(first) == [_span(4, 1000, 1010)]
    assert clock.feed(last) == [_span(5, 1010, 1030)]  # the final segments fill in the missing one
    assert clock.take() == clock.spans == [_span(4, 1000, 1010), _span(5, 1010, 1030)]
    assert clock.take() == []


def test_word_times_ride_on_their_sentence_and_may_be_the_cues():
    from chattts_serve.models.family import Word
    from chattts_serve.server.captions import segment_fields
    from chattts_serve.server.protocol import Segment

    words = (Word("Hello", 0, 9600), Word("world", 9600, 21600), Word("", 21600, 21600))
    timed = SegmentSpan(0, "Hello world.", 0, 24000, 24000, words)
    fields = segment_fields(timed)
    assert fields["words"][:2] == [
        {"word": "Hello", "start_time": 0.0, "end_time": 0.4},
        {"word": "world", "start_time": 0.4, "end_time": 0.9},
    ]
    assert Segment(**fields).model_dump() == fields
    assert Segment(**segment_fields(_span(0, 0, 10))).model_dump() == segment_fields(_span(0, 0, 10))  # no "words"
    assert "words" not in segment_fields(_span(0, 0, 10))
    srt = subtitles([timed], "srt", "word")
    assert srt == "1\n00:00:00,000 --> 00:00:00,400\nHello\n\n2\n00:00:00,400 --> 00:00:00,900\nworld\n"
    assert subtitles([timed], "vtt", "word").count("-->") == 2
    assert subtitles([_span(0, 0, 10)], "srt", "word") == ""  # a sentence-timed span has no word cues
    with pytest.raises(ValueError, match="sentence or word"):
        subtitles([timed], "srt", "syllable")
