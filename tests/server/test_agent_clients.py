"""Voice-agent frameworks through their own OpenAI TTS clients, driven directly against a real server process:
Pipecat's ``OpenAITTSService`` (``response_format="pcm"``, 24 kHz, OpenAI's voice names only) in a Pipecat
pipeline, and LiveKit Agents' ``openai.TTS`` (``gpt-4o-mini-tts`` with ``stream_format="sse"`` and mp3 by
default). Neither can send ChatTTS options, so the servers set them (``--default-options``)."""

from __future__ import annotations

import asyncio
import json

import httpx
import numpy as np
import pytest

from .conftest import HTTP_TIMEOUT, SR, expected_samples, metric, metrics_text, start_server, wait_until

pytest.importorskip("pipecat")
pytest.importorskip("livekit.plugins.openai")

from livekit.agents.metrics import TTSMetrics  # noqa: E402
from livekit.plugins import openai as lk_openai  # noqa: E402
from pipecat.frames.frames import (  # noqa: E402
    EndFrame,
    ErrorFrame,
    InterruptionFrame,
    TTSAudioRawFrame,
    TTSSpeakFrame,
)
from pipecat.pipeline.pipeline import Pipeline  # noqa: E402
from pipecat.pipeline.worker import PipelineParams, PipelineWorker  # noqa: E402
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor  # noqa: E402
from pipecat.services.openai.tts import VALID_VOICES, OpenAITTSService  # noqa: E402
from pipecat.workers.runner import WorkerRunner  # noqa: E402

pytestmark = pytest.mark.e2e

TOKENS = 40
TEXT = "今天天气真不错。"
LONG_STEPS = 2000  # far longer than any test waits for: a request that ends early was aborted
# mp3 at 24 kHz: LAME's encoder delay + the decoder's (no gapless tag in a stream), 576-sample frames
MP3_PRIMING, MP3_FRAME = 1105, 576
ABORTED = {"endpoint": "speech", "status": "aborted"}


def _defaults(steps: int) -> str:
    return json.dumps({"seed": 1, "refine_text": False, "min_new_tokens": steps, "max_new_tokens": steps})


@pytest.fixture(scope="module")
def short(tiny_ckpt, tmp_path_factory):
    """Every request: seeded, TOKENS steps per sentence."""
    with start_server(
        tiny_ckpt, tmp_path_factory.mktemp("agents"), "--max-num-seqs", "4", "--default-options", _defaults(TOKENS)
    ) as srv:
        yield srv.base


@pytest.fixture(scope="module")
def long(tiny_ckpt, tmp_path_factory):
    """Every request runs LONG_STEPS steps unless it is aborted."""
    with start_server(
        tiny_ckpt,
        tmp_path_factory.mktemp("agents-long"),
        "--max-num-seqs", "2",
        "--default-options", _defaults(LONG_STEPS),
        "--no-warmup",
    ) as srv:  # fmt: skip
        yield srv.base


def _http_pcm(base: str, voice: str, text: str = TEXT) -> bytes:
    """The same request as Pipecat's, made directly."""
    body = {"model": "gpt-4o-mini-tts", "voice": voice, "input": text, "response_format": "pcm"}
    r = httpx.post(base + "/v1/audio/speech", json=body, timeout=HTTP_TIMEOUT)
    assert r.status_code == 200, r.text
    return r.content


# ------------------------------------------------------------------------------------------------ Pipecat


class _Collect(FrameProcessor):
    """The end of the pipeline: keeps the TTS audio and errors; ``first_audio`` is set on the first audio."""

    def __init__(self) -> None:
        super().__init__()
        self.audio: list[TTSAudioRawFrame] = []
        self.errors: list[ErrorFrame] = []
        self.first_audio = asyncio.Event()

    async def process_frame(self, frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if isinstance(frame, TTSAudioRawFrame):
            self.audio.append(frame)
            self.first_audio.set()
        elif isinstance(frame, ErrorFrame):
            self.errors.append(frame)
        await self.push_frame(frame, direction)


def _pipecat(base: str, voice: str) -> tuple[PipelineWorker, _Collect]:
    tts = OpenAITTSService(base_url=f"{base}/v1", api_key="unused", settings=OpenAITTSService.Settings(voice=voice))
    sink = _Collect()
    worker = PipelineWorker(Pipeline([tts, sink]), params=PipelineParams(audio_out_sample_rate=SR), enable_rtvi=False)
    return worker, sink


async def _pipecat_speak(base: str, voice: str, texts: list[str]) -> _Collect:
    worker, sink = _pipecat(base, voice)
    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    await worker.queue_frames([*(TTSSpeakFrame(t) for t in texts), EndFrame()])
    await asyncio.wait_for(runner.run(), 120)
    return sink


def test_pipecat_voice_names_are_ours():
    from chattts_serve.server.voices import BUILTIN_VOICES

    assert set(VALID_VOICES) <= set(BUILTIN_VOICES)  # every name Pipecat accepts is a speaker here


@pytest.mark.parametrize("voice", sorted(VALID_VOICES))
def test_pipecat_every_voice(short, voice):
    """Each sentence is one request; the audio is 24 kHz PCM, exactly what the server made."""
    sink = asyncio.run(_pipecat_speak(short, voice, [TEXT]))
    assert not sink.errors, [e.error for e in sink.errors]
    assert {(f.sample_rate, f.num_channels) for f in sink.audio} == {(SR, 1)}
    pcm = b"".join(f.audio for f in sink.audio)
    assert len(pcm) == 2 * expected_samples(TOKENS)
    assert pcm == _http_pcm(short, voice)


def test_pipecat_one_request_per_sentence(short):
    before = metric(short, "chattts_requests_total", {"endpoint": "speech", "status": "length"})
    sink = asyncio.run(_pipecat_speak(short, "marin", ["今天天气真不错。", "我们去公园吧。"]))
    assert not sink.errors, [e.error for e in sink.errors]
    assert len(b"".join(f.audio for f in sink.audio)) == 2 * 2 * expected_samples(TOKENS)
    assert metric(short, "chattts_requests_total", {"endpoint": "speech", "status": "length"}) == before + 2


def test_pipecat_interruption_frees_the_slot(long):
    """A user interrupts while the bot speaks: Pipecat's InterruptionFrame cancels the TTS request mid-stream,
    and the server frees its KV slot at once (the request asked for LONG_STEPS steps)."""
    aborted = metric(long, "chattts_requests_total", ABORTED)

    async def run() -> None:
        worker, sink = _pipecat(long, "alloy")
        runner = WorkerRunner(handle_sigint=False)
        await runner.add_workers(worker)
        running = asyncio.ensure_future(runner.run())
        try:
            await worker.queue_frame(TTSSpeakFrame(TEXT))
            await asyncio.wait_for(sink.first_audio.wait(), 60)
            text = await asyncio.to_thread(metrics_text, long)
            assert metric(long, "chattts_kv_slots_used", text=text) == 1, text
            await worker.queue_frame(InterruptionFrame())
            freed = await asyncio.to_thread(wait_until, lambda: metric(long, "chattts_kv_slots_used") == 0, 30)
            assert freed, f"the interrupted request kept its slot:\n{metrics_text(long)}"
        finally:
            await worker.cancel()
            await asyncio.wait_for(running, 60)

    asyncio.run(run())
    aborted_once = wait_until(lambda: metric(long, "chattts_requests_total", ABORTED) == aborted + 1, timeout=30)
    assert aborted_once, metrics_text(long)
    assert metric(long, "chattts_requests_in_flight") == 0


# ------------------------------------------------------------------------------------------------ LiveKit


async def _livekit_speak(base: str, **options) -> tuple[list, list[TTSMetrics]]:
    tts = lk_openai.TTS(base_url=f"{base}/v1", api_key="unused", **options)
    usage: list[TTSMetrics] = []
    tts.on("metrics_collected", usage.append)
    try:
        async with tts.synthesize(TEXT) as stream:
            frames = [ev.frame async for ev in stream]
    finally:
        await tts.aclose()
    return frames, usage


@pytest.mark.parametrize(
    "options, fmt",
    [
        ({"voice": "alloy"}, "mp3"),  # the defaults: gpt-4o-mini-tts, SSE with mp3 deltas
        ({"voice": "cedar", "response_format": "pcm"}, "pcm"),  # SSE with PCM deltas
        ({"voice": "ash", "model": "tts-1"}, "mp3"),  # tts-1: raw audio, no SSE
        ({"voice": "coral", "model": "tts-1", "response_format": "wav"}, "wav"),
    ],
    ids=["default-sse-mp3", "sse-pcm", "tts-1-mp3", "tts-1-wav"],
)
def test_livekit_tts(short, options, fmt):
    frames, usage = asyncio.run(_livekit_speak(short, **options))
    assert frames and {(f.sample_rate, f.num_channels) for f in frames} == {(SR, 1)}
    samples = np.concatenate([np.frombuffer(f.data, dtype=np.int16) for f in frames])
    expected = expected_samples(TOKENS)
    # LiveKit may end a segment with a 10 ms silent marker frame of its own (not audio from the server)
    marker = SR // 100
    if fmt == "mp3":
        assert abs(len(samples) - MP3_PRIMING - expected) <= MP3_FRAME + marker, len(samples)
    else:
        assert len(samples) - expected in (0, marker), len(samples)
        assert samples[:expected].tobytes() == _http_pcm(short, options["voice"])
        assert not samples[expected:].any()
    [m] = usage
    assert m.audio_duration == pytest.approx(len(samples) / SR) and not m.cancelled
    if options.get("model", "gpt-4o-mini-tts") == "gpt-4o-mini-tts":  # SSE: speech.audio.done carries usage
        assert m.output_tokens == TOKENS and m.input_tokens > 0


def test_livekit_interruption_frees_the_slot(long):
    """The agent's speech is interrupted: the task consuming the synthesis is cancelled mid-stream, the stream
    closes, and the server frees the slot at once."""
    aborted = metric(long, "chattts_requests_total", ABORTED)

    async def run() -> None:
        tts = lk_openai.TTS(base_url=f"{long}/v1", api_key="unused", voice="alloy")
        first = asyncio.Event()

        async def speak() -> None:
            async with tts.synthesize(TEXT) as stream:
                async for _ in stream:
                    first.set()

        speaking = asyncio.ensure_future(speak())
        try:
            await asyncio.wait_for(first.wait(), 60)
            text = await asyncio.to_thread(metrics_text, long)
            assert metric(long, "chattts_kv_slots_used", text=text) == 1, text
            speaking.cancel()
            await asyncio.gather(speaking, return_exceptions=True)  # however the plugin unwinds a cancelled stream
            freed = await asyncio.to_thread(wait_until, lambda: metric(long, "chattts_kv_slots_used") == 0, 30)
            assert freed, f"the interrupted request kept its slot:\n{metrics_text(long)}"
        finally:
            speaking.cancel()
            await tts.aclose()

    asyncio.run(run())
    aborted_once = wait_until(lambda: metric(long, "chattts_requests_total", ABORTED) == aborted + 1, timeout=30)
    assert aborted_once, metrics_text(long)
    assert metric(long, "chattts_requests_in_flight") == 0


@pytest.mark.parametrize("model", ["tts-1", "gpt-4o-mini-tts"])  # raw audio; SSE (the plugin's default)
def test_livekit_reports_a_failure_mid_stream(tiny_ckpt, tmp_path, model):
    """A synthesis that fails after its first audio cuts the response, and the plugin raises (its retry
    logic then takes over; here retries are off). With SSE the server sends an ``error`` event first, which
    the plugin ignores: only the cut body after it makes the failure visible to LiveKit."""
    from livekit.agents import APIConnectionError, APIConnectOptions

    from chattts_serve.engine.async_engine import AsyncEngine
    from chattts_serve.engine.config import EngineConfig
    from chattts_serve.engine.engine import Engine

    from .test_faults import fault, in_process_server

    engine = AsyncEngine(Engine.from_pretrained(tiny_ckpt, config=EngineConfig.with_slots(1)))
    frames: list = []

    async def speak(base: str) -> None:
        tts = lk_openai.TTS(base_url=f"{base}/v1", api_key="unused", voice="alloy", model=model, response_format="pcm")
        try:
            async with tts.synthesize(TEXT, conn_options=APIConnectOptions(max_retry=0)) as stream:
                async for ev in stream:
                    frames.append(ev.frame)
        finally:
            await tts.aclose()

    with in_process_server(engine, tmp_path, default_options=_defaults(200)) as base:
        with fault(engine.core.stage.runner, "execute", after=60):  # after the first audio (14 steps) left
            with pytest.raises(APIConnectionError):
                asyncio.run(speak(base))
    assert frames, "the failure came before any audio: not the mid-stream case"
