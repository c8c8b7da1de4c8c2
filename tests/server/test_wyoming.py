"""The Wyoming protocol server (server/wyoming.py) driven by the ``wyoming`` package's own async TCP client, against
a real ``chattts-serve serve --wyoming-uri`` process (HTTP next to it, on the same engine) and the standalone
``chattts-serve wyoming`` command."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.client import AsyncTcpClient
from wyoming.error import Error
from wyoming.event import Event, async_read_event
from wyoming.info import Describe, Info
from wyoming.ping import Ping, Pong
from wyoming.tts import (
    Synthesize,
    SynthesizeChunk,
    SynthesizeStart,
    SynthesizeStop,
    SynthesizeStopped,
    SynthesizeVoice,
)

from .conftest import HTTP_TIMEOUT, STARTUP_TIMEOUT, expected_samples, free_port, metric, start_server, wait_until

TOKENS = 40
DEFAULTS = {"seed": 1, "refine_text": False, "min_new_tokens": TOKENS, "max_new_tokens": TOKENS}
OPENAI_VOICES = (
    "alloy", "ash", "ballad", "cedar", "coral", "echo", "fable", "marin", "nova", "onyx", "sage", "shimmer", "verse"
)  # fmt: skip
READ_TIMEOUT = 60


@pytest.fixture(scope="module")
def wy(tiny_ckpt, tmp_path_factory):
    """HTTP and Wyoming in one process; every request defaults to a seeded, fixed-length utterance (Home
    Assistant cannot send ChatTTS options)."""
    port = free_port()
    with start_server(
        tiny_ckpt,
        tmp_path_factory.mktemp("wyoming"),
        "--max-num-seqs", "2",
        "--wyoming-uri", f"tcp://127.0.0.1:{port}",
        "--default-options", json.dumps(DEFAULTS),
        "--ws-max-pending-sentences", "4",
        in_process=True,
    ) as srv:  # fmt: skip
        yield srv.base, port


def client(port: int) -> AsyncTcpClient:
    return AsyncTcpClient("127.0.0.1", port, connect_timeout=10, read_timeout=READ_TIMEOUT)


async def read_until(c: AsyncTcpClient, last: str) -> list[Event]:
    """Every event up to and including the first of type ``last`` (or an error, or the end)."""
    events = []
    while True:
        event = await c.read_event()
        if event is None:
            return events
        events.append(event)
        if event.type in (last, "error"):
            return events


def audio_of(events: list[Event]) -> bytes:
    return b"".join(AudioChunk.from_event(e).audio for e in events if AudioChunk.is_type(e.type))


def check_audio_events(events: list[Event], streaming: bool = False) -> bytes:
    """One audio-start (24 kHz, 16-bit, mono), chunks of that format with increasing timestamps, one audio-stop
    (then synthesize-stopped when streaming); returns the PCM."""
    types = [e.type for e in events]
    assert types[0] == "audio-start", types[:5]
    assert types.count("audio-start") == 1 and types.count("audio-stop") == 1, types
    assert set(types) <= {"audio-start", "audio-chunk", "audio-stop", "synthesize-stopped"}, set(types)
    assert types[-1] == ("synthesize-stopped" if streaming else "audio-stop"), types[-3:]
    start = AudioStart.from_event(events[0])
    assert (start.rate, start.width, start.channels) == (24000, 2, 1)
    chunks = [AudioChunk.from_event(e) for e in events if AudioChunk.is_type(e.type)]
    assert chunks, "no audio"
    assert {(c.rate, c.width, c.channels) for c in chunks} == {(24000, 2, 1)}
    stamps = [c.timestamp for c in chunks]
    assert stamps == sorted(stamps) and stamps[0] == 0
    pcm = audio_of(events)
    stop = AudioStop.from_event(next(e for e in events if AudioStop.is_type(e.type)))
    assert stop.timestamp == len(pcm) // 2 * 1000 // 24000
    return pcm


def test_describe_lists_one_tts_program_with_every_voice(wy):
    base, port = wy
    r = httpx.post(base + "/v1/voices", json={"name": "narrator", "seed": 3, "description": "a saved voice"})
    assert r.status_code == 201, r.text

    async def describe() -> Info:
        async with client(port) as c:
            await c.write_event(Describe().event())
            event = await c.read_event()
            assert event is not None and Info.is_type(event.type), event
            return Info.from_event(event)

    info = asyncio.run(describe())
    assert len(info.tts) == 1 and not info.asr and not info.wake
    program = info.tts[0]
    assert program.name == "chattts" and program.installed and program.supports_synthesize_streaming
    assert program.description == "ChatTTS text to speech, 24000 Hz (chattts-serve)"
    assert program.attribution.name == "2noise"
    assert next(v for v in program.voices if v.name == "alloy").description == "alloy (OpenAI voice name)"
    names = [v.name for v in program.voices]
    assert set(OPENAI_VOICES) <= set(names) and "narrator" in names
    assert len(names) == len(set(names))
    assert all(v.languages == ["zh", "en"] and v.installed for v in program.voices)
    # Names only: a saved voice's description is its creator's text, kept out of an answer anyone may ask for.
    assert next(v for v in program.voices if v.name == "narrator").description == "saved voice"


async def _describe_all(port: int, connections: int, per_connection: int = 1) -> list[list[str]]:
    """The voice names of each ``info``, from ``per_connection`` describes on each of ``connections`` clients."""

    async def one() -> list[list[str]]:
        async with client(port) as c:
            out = []
            for _ in range(per_connection):
                await c.write_event(Describe().event())
                event = await c.read_event()
                assert event is not None and Info.is_type(event.type), event
                out.append([v.name for v in Info.from_event(event).tts[0].voices])
            return out

    results = await asyncio.gather(*(one() for _ in range(connections)))
    return [names for per in results for names in per]


def test_describe_is_cached_capped_and_built_off_the_loop(wy, monkeypatch):
    """Describe needs no key: its answer is built once per voice change (not per describe), in a worker thread,
    and lists at most DESCRIBED_SAVED_VOICES saved voices however many the store holds."""
    from chattts_serve.server import wyoming

    base, port = wy
    builds: list[bool] = []  # per build: did it run on an event loop?
    build = wyoming._build_info

    def counted(store, builtin):
        try:
            asyncio.get_running_loop()
            builds.append(True)
        except RuntimeError:
            builds.append(False)
        return build(store, builtin)

    monkeypatch.setattr(wyoming, "_build_info", counted)
    monkeypatch.setattr(wyoming, "DESCRIBED_SAVED_VOICES", 3)
    for i in range(5):
        r = httpx.post(base + "/v1/voices", json={"name": f"capped-{i}", "seed": 10 + i})
        assert r.status_code == 201, r.text
    answers = asyncio.run(_describe_all(port, connections=8))
    assert len(builds) == 1, builds  # eight describes, one database read
    assert not any(builds), "built on the event loop"
    assert all(names == answers[0] for names in answers)
    saved = [n for n in answers[0] if n not in OPENAI_VOICES]
    assert len(saved) == 3 and set(OPENAI_VOICES) <= set(answers[0]), answers[0]
    # A voice deleted (a change to the store) rebuilds it at the next describe.
    assert httpx.delete(base + f"/v1/voices/{saved[0]}").status_code == 200
    (names,) = asyncio.run(_describe_all(port, connections=1))
    assert len(builds) == 2 and saved[0] not in names, (builds, names)


def test_describe_is_throttled_per_connection(wy, monkeypatch):
    """One info per DESCRIBE_INTERVAL_S per connection: with the interval at 30 s, a second describe on a
    connection gets no answer within 2 s, while other connections' first describes are answered (well
    within the interval: they do not queue behind it)."""
    from chattts_serve.server import wyoming

    _, port = wy
    monkeypatch.setattr(wyoming, "DESCRIBE_INTERVAL_S", 30.0)

    async def scenario() -> None:
        async with client(port) as c:
            await c.write_event(Describe().event())
            assert Info.is_type((await c.read_event()).type)
            await c.write_event(Describe().event())
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(c.read_event(), 2)  # throttled: its turn comes 30 s after the first
            others = await asyncio.wait_for(_describe_all(port, connections=3), 20)
            assert len(others) == 3

    asyncio.run(scenario())


def test_synthesize_matches_the_same_request_over_http(wy):
    base, port = wy

    async def speak() -> list[Event]:
        async with client(port) as c:
            await c.write_event(Synthesize(text="今天天气真不错。", voice=SynthesizeVoice(name="nova")).event())
            return await read_until(c, "audio-stop")

    events = asyncio.run(speak())
    pcm = check_audio_events(events)
    assert all(len(AudioChunk.from_event(e).audio) <= 2 * 1024 for e in events if e.type == "audio-chunk")
    # The same text, voice and (default) options over HTTP: the same seeded audio, sample for sample.
    r = httpx.post(base + "/v1/tts", json={"text": "今天天气真不错。", "voice": "nova", "format": "pcm"}, timeout=60)
    assert r.status_code == 200, r.text
    assert len(pcm) == len(r.content) == 2 * expected_samples(TOKENS)
    assert pcm == r.content


@pytest.mark.parametrize(
    "sentences",
    [
        ["今天天气真不错。", "我们去公园散步吧。", "晚上回家吃饭。"],
        # Home Assistant forwards an LLM's chunks as they come: pieces end mid-word and mid-number ("23." of
        # 23.5 is no sentence end), and an ASCII full stop is decided by the character after it.
        ["It is 23.5 degrees in Berlin today.", " See dapr.io for more.", " Bye for now."],
    ],
    ids=["zh", "en-numbers"],
)
def test_streaming_synthesis_speaks_each_sentence_as_it_arrives(wy, sentences):
    base, port = wy
    text = "".join(sentences)
    pieces = [text[i * len(text) // 10 : (i + 1) * len(text) // 10] for i in range(10)]
    first_end = len(sentences[0]) + (sentences[0][-1] == ".")  # the space after a "." decides it
    # the pieces that complete the first sentence, and the rest
    cut = next(i for i in range(10) if sum(map(len, pieces[: i + 1])) >= first_end) + 1

    async def stream() -> tuple[list[Event], list[Event]]:
        async with client(port) as c:
            await c.write_event(SynthesizeStart(voice=SynthesizeVoice(name="alloy")).event())
            for piece in pieces[:cut]:
                await c.write_event(SynthesizeChunk(text=piece).event())
            # The first sentence is complete: its audio comes before any more text is sent.
            early = []
            while not any(e.type == "audio-chunk" for e in early):
                early.append(await c.read_event())
            for piece in pieces[cut:]:
                await c.write_event(SynthesizeChunk(text=piece).event())
            # Home Assistant also sends the whole text as a legacy synthesize: it must not be spoken again.
            await c.write_event(Synthesize(text=text, voice=SynthesizeVoice(name="alloy")).event())
            await c.write_event(SynthesizeStop().event())
            return early, await read_until(c, "synthesize-stopped")

    done = {"endpoint": "wyoming", "status": "length"}  # fixed-length requests end by length
    before = metric(base, "chattts_requests_total", done)
    early, rest = asyncio.run(stream())
    events = early + rest
    pcm = check_audio_events(events, streaming=True)
    assert SynthesizeStopped.is_type(events[-1].type)
    # one fixed-length utterance per sentence (the legacy synthesize added nothing)
    assert len(pcm) == 2 * len(sentences) * expected_samples(TOKENS)
    assert metric(base, "chattts_requests_total", done) == before + len(sentences)  # one request per sentence


def test_streaming_text_without_a_sentence_end_is_spoken_at_the_stop(wy):
    _, port = wy

    async def stream() -> list[Event]:
        async with client(port) as c:
            await c.write_event(SynthesizeStart().event())
            for piece in ("你好", "世界"):
                await c.write_event(SynthesizeChunk(text=piece).event())
            await c.write_event(SynthesizeStop().event())
            return await read_until(c, "synthesize-stopped")

    pcm = check_audio_events(asyncio.run(stream()), streaming=True)
    assert len(pcm) == 2 * expected_samples(TOKENS)


def test_nothing_to_say_is_an_empty_audio_stream(wy):
    _, port = wy

    async def run() -> tuple[list[Event], list[Event]]:
        async with client(port) as c:
            await c.write_event(Synthesize(text="。。。").event())
            one = await read_until(c, "audio-stop")
            await c.write_event(SynthesizeStart().event())
            await c.write_event(SynthesizeStop().event())
            return one, await read_until(c, "synthesize-stopped")

    one, stream = asyncio.run(run())
    assert [e.type for e in one] == ["audio-start", "audio-stop"]
    assert [e.type for e in stream] == ["audio-start", "audio-stop", "synthesize-stopped"]


def test_ping_and_unknown_events(wy):
    _, port = wy

    async def run() -> Event:
        async with client(port) as c:
            await c.write_event(Event(type="transcribe", data={"name": "x"}))  # not ours: ignored
            await c.write_event(Ping(text="hi").event())
            return await c.read_event()

    event = asyncio.run(run())
    assert Pong.is_type(event.type) and Pong.from_event(event).text == "hi"


@pytest.mark.parametrize("streaming", [False, True], ids=["synthesize", "synthesize-stream"])
def test_disconnect_mid_stream_frees_the_slot(wy, streaming):
    base, port = wy
    aborted = metric(base, "chattts_requests_total", {"endpoint": "wyoming", "status": "aborted"})
    # 2000 steps: the request would run far longer than the test waits for it
    long = {"min_new_tokens": 2000, "max_new_tokens": 2000}

    async def leave_after_first_audio() -> None:
        c = client(port)
        await c.connect()
        if streaming:
            await c.write_event(Event("synthesize-start", {"chattts": long}))
            await c.write_event(SynthesizeChunk(text="今天天气真不错。").event())
        else:
            await c.write_event(Event("synthesize", {"text": "今天天气真不错。", "chattts": long}))
        while True:
            event = await c.read_event()
            assert event is not None and event.type != "error", event
            if event.type == "audio-chunk":
                break
        # Audio arrives while the request is still generating (as it is made, not after the utterance).
        assert await asyncio.to_thread(metric, base, "chattts_kv_slots_used") == 1
        await c.disconnect()

    asyncio.run(leave_after_first_audio())
    assert wait_until(lambda: metric(base, "chattts_kv_slots_used") == 0, timeout=30)
    assert wait_until(
        lambda: metric(base, "chattts_requests_total", {"endpoint": "wyoming", "status": "aborted"}) == aborted + 1,
        timeout=30,
    )
    assert metric(base, "chattts_requests_in_flight") == 0


def test_disconnect_while_queued_aborts_the_request(wy):
    """Two connections hold both KV slots; a third request waits in the queue and its client leaves."""
    base, port = wy
    aborted = metric(base, "chattts_requests_total", {"endpoint": "wyoming", "status": "aborted"})
    long = {"text": "今天天气真不错。", "chattts": {"min_new_tokens": 2000, "max_new_tokens": 2000}}

    async def run() -> None:
        holders = [client(port) for _ in range(2)]
        for c in holders:
            await c.connect()
            await c.write_event(Event("synthesize", long))
            assert (await c.read_event()).type == "audio-start"
        waiter = client(port)
        await waiter.connect()
        await waiter.write_event(Event("synthesize", long))
        ok = await asyncio.to_thread(wait_until, lambda: metric(base, "chattts_queue_depth") == 1, 30)
        assert ok, "the third request never queued"
        await waiter.disconnect()
        ok = await asyncio.to_thread(wait_until, lambda: metric(base, "chattts_queue_depth") == 0, 30)
        assert ok, "the queued request stayed after its client left"
        for c in holders:
            await c.disconnect()

    asyncio.run(run())
    assert wait_until(lambda: metric(base, "chattts_kv_slots_used") == 0, timeout=30)
    assert wait_until(
        lambda: metric(base, "chattts_requests_total", {"endpoint": "wyoming", "status": "aborted"}) == aborted + 3,
        timeout=30,
    )


GARBAGE = {
    "not JSON": b"\x00\xff\xfe garbage \x01\n",
    "JSON, not an event": b"[1, 2, 3]\n",
    "no type": b'{"data": {"text": "hi"}}\n',
    "bad data length": b'{"type": "synthesize", "data_length": -5}\n',
    "huge payload announced": b'{"type": "audio-chunk", "payload_length": 1000000000}\n',
    "data not JSON": b'{"type": "synthesize", "data_length": 4}\nxxxx',
    "endless header": b"{" + b"x" * 200_000,
}


async def _raw_exchange(port: int, data: bytes) -> list[Event]:
    """Write raw bytes; every event the server answers until it closes the connection."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 10)
    writer.write(data)
    events = []
    try:
        await writer.drain()
        while (event := await asyncio.wait_for(async_read_event(reader), READ_TIMEOUT)) is not None:
            events.append(event)
    except ConnectionError:  # the server closed while a large write was still going out
        pass
    finally:
        writer.close()
    return events


@pytest.mark.parametrize("data", GARBAGE.values(), ids=GARBAGE.keys())
def test_garbage_bytes_get_an_error_event_and_a_close(wy, data):
    base, port = wy
    events = asyncio.run(_raw_exchange(port, data))
    assert [e.type for e in events] == ["error"], events
    err = Error.from_event(events[0])
    assert err.code in ("invalid_event", "event_too_big") and err.text
    assert httpx.get(base + "/health", timeout=HTTP_TIMEOUT).status_code == 200


BAD_EVENTS = {
    "synthesize without text": ([Event("synthesize", {"voice": {"name": "alloy"}})], "invalid_event"),
    "text not a string": ([Event("synthesize", {"text": 5})], "invalid_event"),
    "unknown voice": ([Synthesize(text="你好。", voice=SynthesizeVoice(name="nobody")).event()], "unknown_voice"),
    "voice not an object": ([Event("synthesize", {"text": "你好。", "voice": "alloy"})], "invalid_event"),
    "bad option": ([Event("synthesize", {"text": "你好。", "chattts": {"temperature": -1}})], "invalid_request"),
    "unknown option": ([Event("synthesize", {"text": "你好。", "chattts": {"volume": 11}})], "invalid_request"),
    "text too long": ([Synthesize(text="你好。" * 2000).event()], "input_too_long"),
    # 4 KB that a lexicon makes a megabyte: the bound holds after the expansion, and no key is needed to try
    "lexicon past the bound": (
        [Event("synthesize", {"text": "a" * 4000, "chattts": {"lexicon": {"a": "啊" * 256}}})],
        "input_too_long",
    ),
    "chunk without start": ([SynthesizeChunk(text="你好。").event()], "invalid_event"),
    "stop without start": ([SynthesizeStop().event()], "invalid_event"),
    "two starts": ([SynthesizeStart().event(), SynthesizeStart().event()], "invalid_event"),
}


@pytest.mark.parametrize("events,code", BAD_EVENTS.values(), ids=BAD_EVENTS.keys())
def test_bad_events_get_an_error_event_and_a_close(wy, events, code):
    _, port = wy

    async def run() -> list[Event]:
        async with client(port) as c:
            for event in events:
                await c.write_event(event)
            return await read_until(c, "never")  # up to the error, then the close

    answer = asyncio.run(run())
    assert [e.type for e in answer] == ["error"], answer
    assert Error.from_event(answer[0]).code == code


def test_garbage_does_not_disturb_another_client(wy):
    """A synthesis in flight on one connection completes while other connections send garbage."""
    _, port = wy

    async def run() -> tuple[list[Event], list[list[Event]]]:
        async with client(port) as c:
            await c.write_event(Synthesize(text="今天天气真不错。").event())
            junk = await asyncio.gather(*(_raw_exchange(port, data) for data in GARBAGE.values()))
            return await read_until(c, "audio-stop"), junk

    events, junk = asyncio.run(run())
    assert len(check_audio_events(events)) == 2 * expected_samples(TOKENS)
    assert all([e.type for e in answer] == ["error"] for answer in junk)


# ------------------------------------------------------------------------------------ the standalone command


@pytest.mark.integration
def test_standalone_wyoming_command(tiny_ckpt, tmp_path):
    """``chattts-serve wyoming``: no HTTP, the same engine options and limits; idle connections are closed;
    SIGTERM stops it cleanly."""
    port = free_port()
    cmd = [
        sys.executable, "-m", "chattts_serve.cli", "wyoming",
        "--model", str(tiny_ckpt),
        "--uri", f"tcp://127.0.0.1:{port}",
        "--voices-db", str(tmp_path / "voices.sqlite3"),
        "--threads", "1", "--max-num-seqs", "1", "--no-warmup",
        "--default-options", json.dumps(DEFAULTS),
        "--ws-idle-timeout-s", "1",
    ]  # fmt: skip
    log = tmp_path / "wyoming.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:

        async def connect() -> AsyncTcpClient:
            deadline = time.monotonic() + STARTUP_TIMEOUT
            while True:
                assert proc.poll() is None, log.read_text()
                try:
                    c = client(port)
                    await c.connect()
                    return c
                except OSError:
                    assert time.monotonic() < deadline, "the wyoming server did not start"
                    await asyncio.sleep(0.2)

        async def run() -> tuple[Info, list[Event], list[Event]]:
            c = await connect()
            await c.write_event(Describe().event())
            info = Info.from_event(await c.read_event())
            await c.write_event(Synthesize(text="你好。", voice=SynthesizeVoice(name="echo")).event())
            audio = await read_until(c, "audio-stop")
            idle = await read_until(c, "never")  # nothing more is sent: the idle timeout closes it
            await c.disconnect()
            return info, audio, idle

        info, audio, idle = asyncio.run(run())
        assert info.tts[0].name == "chattts"
        assert len(check_audio_events(audio)) == 2 * expected_samples(TOKENS)
        assert [e.type for e in idle] == ["error"] and Error.from_event(idle[0]).code == "idle_timeout"
        assert "chattts-serve wyoming: tcp://127.0.0.1" in log.read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_wyoming_uri_is_checked_at_start():
    from chattts_serve.server.config import ServerConfig

    for bad in ("10200", "tcp://127.0.0.1", "http://127.0.0.1:10200", "stdio://"):
        with pytest.raises(ValueError, match="wyoming_uri"):
            ServerConfig.from_flat(wyoming_uri=bad)
    with pytest.raises(ValueError, match="wyoming_zeroconf"):
        ServerConfig.from_flat(wyoming_uri="unix:///tmp/wyoming.sock", wyoming_zeroconf="chattts")
    assert ServerConfig.from_flat(wyoming_uri="tcp://0.0.0.0:10200").wyoming.uri == "tcp://0.0.0.0:10200"


def test_pcm_of_a_chunk_is_little_endian_int16(wy):
    """The payload is what audio-start announces: signed 16-bit little-endian samples in [-1, 1] scale."""
    _, port = wy

    async def speak() -> bytes:
        async with client(port) as c:
            await c.write_event(Synthesize(text="你好。").event())
            return audio_of(await read_until(c, "audio-stop"))

    samples = np.frombuffer(asyncio.run(speak()), dtype="<i2")
    assert len(samples) == expected_samples(TOKENS) and np.abs(samples).max() > 0


@pytest.mark.integration
def test_zeroconf_announces_the_server(tiny_ckpt, tmp_path):
    """``--wyoming-zeroconf NAME``: Home Assistant's discovery (mDNS ``_wyoming._tcp``) finds the server at the
    address and port it listens on; the announcement goes when the server stops."""
    pytest.importorskip("zeroconf")
    from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

    port = free_port()
    name = f"chattts-test-{port}"
    service = f"{name}._wyoming._tcp.local."

    async def resolve() -> AsyncServiceInfo | None:
        zc = AsyncZeroconf()
        try:
            info = AsyncServiceInfo("_wyoming._tcp.local.", service)
            return info if await info.async_request(zc.zeroconf, 10000) else None
        finally:
            await zc.async_close()

    uri = f"tcp://127.0.0.1:{port}"
    with start_server(tiny_ckpt, tmp_path, "--no-warmup", "--wyoming-uri", uri, "--wyoming-zeroconf", name):
        info = asyncio.run(resolve())
        assert info is not None, "the server was not announced"
        assert info.port == port and info.parsed_addresses() == ["127.0.0.1"]
