"""audio.overlap: the audio decode on a stream of its own, its audio collected at a later step.

On a CPU the stream operations are no-ops; a recording fake stands in for CUDA's here, so the order
of the stream and event operations (the part that makes it right on CUDA) is checked without a GPU.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import pytest
import torch

from chattts_serve.audio import decode as decode_module
from chattts_serve.audio.overlap import AudioDecoder, InlineStreams

from .test_decode import _windows


class _Event:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name, self.happened = log, name, False

    def query(self) -> bool:
        return self.happened

    def synchronize(self) -> None:
        self.log.append(("synchronize", self.name))
        self.happened = True


class FakeStreams(InlineStreams):
    """Records every stream operation; events happen only when synchronized or released by the test."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.events: list[_Event] = []
        self.active = "main"

    def current(self) -> str:
        return self.active

    def new(self) -> str:
        return "audio"

    @contextmanager
    def use(self, stream):
        before, self.active = self.active, stream
        self.log.append(("use", stream))
        try:
            yield
        finally:
            self.active = before

    def record(self, stream) -> _Event:
        event = _Event(self.log, f"{stream}#{len(self.events)}")
        self.events.append(event)
        self.log.append(("record", stream, event.name))
        return event

    def wait(self, stream, event) -> None:
        self.log.append(("wait", stream, event.name))

    def keep(self, tensor, stream) -> None:
        self.log.append(("keep", stream))


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    from chattts_serve.models.chattts import checkpoint

    return checkpoint.load(tiny_ckpt)


def _entries(model, lengths):
    return [(f"r{i}", None, w) for i, w in enumerate(_windows(model, lengths))]


def test_decode_waits_for_the_step_and_the_host_waits_for_the_decode(model, monkeypatch):
    streams = FakeStreams()
    launched: list[str] = []
    real = decode_module._decode_batch

    def spy(*args):
        launched.append(streams.active)
        return real(*args)

    monkeypatch.setattr(decode_module, "_decode_batch", spy)
    dec = AudioDecoder(model, torch.device("cpu"), "fp32", overlap=True, buckets=True, streams=streams)
    entries = _entries(model, [6, 9, 6])
    assert dec.submit(entries) == []
    assert launched and set(launched) == {"audio"}  # every kernel on the audio stream
    ops = [op[0] for op in streams.log]
    # The step's event first, then the audio stream waits on it, keeps the buffers it reads, records done.
    assert streams.log[0] == ("record", "main", "main#0")
    assert ops == ["record", "use", "wait", "keep", "keep", "keep", "record"]
    assert streams.log[2] == ("wait", "audio", "main#0") and streams.log[-1] == ("record", "audio", "audio#1")
    assert all(dec.busy(w.stream) for _, _, w in entries) and dec.in_flight == 1
    with pytest.raises(ValueError, match="already being decoded"):
        dec.submit(entries[:1])

    assert dec.collect(wait=False) == []  # not done yet: the host does not wait
    streams.events[-1].happened = True
    [(got, audio)] = dec.collect(wait=False)
    assert got == entries and not any(dec.busy(w.stream) for _, _, w in entries)
    want = decode_module.decode_windows(model, [w for _, _, w in entries])
    for a, b in zip(want, audio, strict=True):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-7)


def test_in_flight_submissions_are_bounded_and_collected_in_order(model):
    streams = FakeStreams()
    dec = AudioDecoder(model, torch.device("cpu"), "fp32", True, False, streams=streams, max_in_flight=2)
    batches = [_entries(model, [n]) for n in (5, 6, 7)]
    assert dec.submit(batches[0]) == [] and dec.submit(batches[1]) == []
    # A third is refused (the caller keeps its windows): the host never waits for the oldest here.
    assert dec.full
    with pytest.raises(RuntimeError, match="in flight"):
        dec.submit(batches[2])
    assert not [op for op in streams.log if op[0] == "synchronize"]
    streams.events[1].happened = True  # the first submission's done event
    [(first, _)] = dec.collect(wait=False)
    assert first == batches[0] and not dec.full
    assert dec.submit(batches[2]) == []
    assert [e for e, _ in dec.collect(wait=True)] == [batches[1], batches[2]]
    assert dec.in_flight == 0
    dec.submit(_entries(model, [4]))
    dec.drop()
    assert dec.in_flight == 0 and dec.collect(wait=True) == []


def test_a_failed_batch_fails_only_its_windows(model, monkeypatch):
    dec = AudioDecoder(model, torch.device("cpu"), "fp32", overlap=False, buckets=False)
    real = decode_module._decode_batch

    def fail_long(model, h, *rest):
        if h.shape[1] == 9:
            raise ValueError("bad window")
        return real(model, h, *rest)

    monkeypatch.setattr(decode_module, "_decode_batch", fail_long)
    entries = _entries(model, [6, 9, 6])
    dec.submit(entries)
    [(_, audio)] = dec.collect(wait=False)  # inline: done when submitted
    assert isinstance(audio[1], ValueError)
    assert [a.shape for i, a in enumerate(audio) if i != 1] == [(512 * 6 - 256,)] * 2


# ---------------------------------------------------------------- the engine with overlap on a CPU


def _stream_run(engine, texts):
    from chattts_serve import SamplingParams
    from chattts_serve.audio.policy import StreamPolicy

    core = engine.core
    params = SamplingParams(seed=5, refine_text=False, min_new_tokens=40, max_new_tokens=40)
    for i, text in enumerate(texts):
        core.add_request(f"r{i}", core.prepare(text, params), StreamPolicy())
    audio: dict[str, list[np.ndarray]] = {f"r{i}": [] for i in range(len(texts))}
    finals, in_flight = {}, 0
    for _ in range(2000):
        if not core.has_unfinished():
            break
        for out in core.step():
            audio[out.request_id].append(out.audio)
            if out.finished:
                finals[out.request_id] = out
        in_flight = max(in_flight, core.stage.decoder.in_flight)
    assert not core.has_unfinished()
    return {rid: np.concatenate(a) for rid, a in audio.items()}, finals, in_flight


def test_overlapped_bucketed_decode_gives_every_stream_the_same_audio(tiny_ckpt):
    """The CUDA arrangement (own stream, collected a step later, bucketed windows) run on a CPU:
    the same codes and, to float rounding, the same audio as the inline exact-length decode."""
    from chattts_serve import Engine
    from chattts_serve.engine.config import EngineConfig

    texts = ["今天天气真不错。", "你好。", "我们一起去公园散步吧。"]
    runs = {}
    for mode in ("off", "on"):
        config = EngineConfig.with_slots(4, audio_overlap=mode, audio_buckets=mode)
        engine = Engine.from_pretrained(tiny_ckpt, config=config)
        assert engine.core.stage.decoder.overlap is (mode == "on") and engine.core.stage.decoder.buckets is (
            mode == "on"
        )
        runs[mode] = _stream_run(engine, texts)
    (want, want_final, inline), (got, got_final, deferred) = runs["off"], runs["on"]
    assert inline == 0 and deferred >= 1  # the overlapped run did leave audio in flight across steps
    for rid in want:
        assert got_final[rid].finish_reason == want_final[rid].finish_reason == "length"
        for a, b in zip(got_final[rid].segments, want_final[rid].segments, strict=True):
            np.testing.assert_array_equal(a.codes, b.codes)
        assert got[rid].shape == want[rid].shape and got[rid].size > 0
        np.testing.assert_allclose(got[rid], want[rid], rtol=0, atol=1e-6, err_msg=rid)


def test_the_engine_never_waits_for_audio_while_the_model_has_work(tiny_ckpt):
    """With the audio stream behind the model (no submission done until waited for), the engine keeps
    stepping: windows wait for room in flight, and the host waits only once there is no model work."""
    from chattts_serve import Engine, SamplingParams
    from chattts_serve.audio.policy import StreamPolicy
    from chattts_serve.engine.config import EngineConfig

    engine = Engine.from_pretrained(tiny_ckpt, device="cpu", config=EngineConfig.with_slots(4, audio_overlap="on"))
    core = engine.core
    streams = FakeStreams()
    core.stage.decoder.streams = streams
    waited_with_work = False
    finished = steps = 0
    while steps == 0 or core.has_unfinished():
        if steps in (0, 4, 8):  # staggered: each stream's first window goes in a submission of its own
            p = SamplingParams(seed=steps, refine_text=False, min_new_tokens=40, max_new_tokens=40)
            core.add_request(f"r{steps}", core.prepare("你好。", p), StreamPolicy(first_chunk=2, max_chunk=4))
        steps += 1
        model_work = core.scheduler.has_unfinished()
        before = len([op for op in streams.log if op[0] == "synchronize"])
        finished += sum(o.finished for o in core.step())
        after = len([op for op in streams.log if op[0] == "synchronize"])
        waited_with_work |= model_work and core.scheduler.has_unfinished() and after > before
    assert finished == 3 and not waited_with_work
    assert core.stage.decoder.in_flight == 0


class _SecondLook:
    """An event that has happened by its second ``query`` (a device a little behind the host)."""

    def __init__(self) -> None:
        self.looks = 0

    def query(self) -> bool:
        self.looks += 1
        return self.looks > 1

    def synchronize(self) -> None:
        self.looks = 2


class SecondLookStreams(InlineStreams):
    def record(self, stream):
        return _SecondLook()


def test_a_voice_steps_codes_come_back_at_a_later_step(tiny_ckpt, monkeypatch):
    """The voice step's DVAE encode is queued and its codes taken once its event has happened, at a
    later step while other requests run: the engine thread does not wait on it (it did: ``.cpu()``)."""
    from chattts_serve import Engine, SamplingParams
    from chattts_serve.engine.config import EngineConfig

    engine = Engine.from_pretrained(tiny_ckpt, device="cpu", config=EngineConfig.with_slots(4, audio_overlap="on"))
    core, stage = engine.core, engine.core.stage
    stage.decoder.streams = SecondLookStreams()
    step = 0
    encoded, sampled = [], []
    real_encode, real_set = stage.model.dvae.encode, stage.pipeline.set_voice_sample
    monkeypatch.setattr(stage.model.dvae, "encode", lambda *a, **k: (encoded.append(step), real_encode(*a, **k))[1])
    monkeypatch.setattr(
        stage.pipeline, "set_voice_sample", lambda *a, **k: (sampled.append(step), real_set(*a, **k))[1]
    )
    voice = SamplingParams(seed=1, refine_text=False, min_new_tokens=40, max_new_tokens=40)
    core.add_request("voice", core.prepare("今天天气不错。我们去公园。", voice))
    long = SamplingParams(seed=2, refine_text=False, min_new_tokens=120, max_new_tokens=120)
    core.add_request("other", core.prepare("你好。", long))
    finished = 0
    while core.has_unfinished():
        step += 1
        finished += sum(o.finished for o in core.step())
    assert finished == 2 and len(encoded) == 1 and len(sampled) == 1
    assert sampled[0] > encoded[0]  # taken at a later step, not waited for
