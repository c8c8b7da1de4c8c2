"""audio.overlap: the audio decode on a stream of its own, its audio collected at a later step.

On a CPU the stream operations are no-ops; a recording fake stands in for CUDA's here, so the order
of the stream and event operations (the part that makes it right on CUDA) is checked without a GPU.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from chattts_serve.audio import decode as decode_module
from chattts_serve.audio.overlap import AudioDecoder, InlineStreams, ThreadStreams

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


# ---------------------------------------------------------------- a CPU's worker thread (``ThreadStreams``)


_EARLIER: set[threading.Thread] = set()
"""Threads alive before the running test began: another test's engine left running in this process (pytest-xdist
runs the tests in another order) is not this test's."""


@pytest.fixture(autouse=True)
def _earlier_threads():
    _EARLIER.clear()
    _EARLIER.update(t for t in threading.enumerate() if t is not threading.current_thread())
    yield
    _EARLIER.clear()


def _audio_threads() -> list[threading.Thread]:
    """This test's audio workers still alive."""
    return [t for t in threading.enumerate() if t.name.startswith("chattts-audio") and t not in _EARLIER]


def test_a_cpu_stream_decodes_on_its_worker_while_the_host_goes_on(model, monkeypatch):
    """``submit`` returns while the worker is still decoding; ``collect`` waits only when told to; the audio is
    the inline decode's, bit for bit; ``close`` joins the worker."""
    streams = ThreadStreams(threads=1)
    gate = threading.Event()
    seen: list[tuple[str, bool, int]] = []
    real = decode_module._decode_batch

    def held(*args):
        me = threading.current_thread()
        seen.append((me.name, torch.is_inference_mode_enabled(), torch.get_num_threads()))
        if me is not threading.main_thread():
            assert gate.wait(60)
        return real(*args)

    monkeypatch.setattr(decode_module, "_decode_batch", held)
    dec = AudioDecoder(model, torch.device("cpu"), "fp32", overlap=True, buckets=False, streams=streams)
    entries = _entries(model, [6, 9, 6])
    assert dec.submit(entries) == []
    assert dec.collect(wait=False) == [] and dec.in_flight == 1  # the worker is held: nothing done, no wait
    assert all(dec.busy(w.stream) for _, _, w in entries) and len(_audio_threads()) == 1
    gate.set()
    [(got, audio)] = dec.collect(wait=True)
    assert got == entries and dec.in_flight == 0
    # Two calls (lengths 6 and 9), both on the worker, without autograd, at the worker's thread count.
    assert [(n.startswith("chattts-audio"), inference, threads) for n, inference, threads in seen] == [
        (True, True, 1)
    ] * 2
    want = decode_module.decode_windows(model, [w for _, _, w in entries])
    for a, b in zip(want, audio, strict=True):
        np.testing.assert_array_equal(b, a)
    dec.close()
    assert not _audio_threads()
    dec.submit(_entries(model, [5]))  # a closed worker starts again at the next work
    [(_, [again])] = dec.collect(wait=True)
    assert again.shape == (512 * 5 - 256,)
    dec.close()
    assert not _audio_threads()


def test_a_submission_not_beside_the_step_decodes_on_the_engine_thread_after_the_worker(model, monkeypatch):
    """``beside=False`` (the step before used every core): what the worker holds is collected first, in order,
    then the windows decode on the calling thread, and all of it comes back from ``submit``, bit for bit the
    audio the worker would give."""
    streams = ThreadStreams(threads=1)
    where: list[str] = []
    real = decode_module._decode_batch

    def recorded(*args):
        where.append(threading.current_thread().name)
        return real(*args)

    monkeypatch.setattr(decode_module, "_decode_batch", recorded)
    dec = AudioDecoder(model, torch.device("cpu"), "fp32", overlap=True, buckets=False, streams=streams)
    first, second = _entries(model, [6]), _entries(model, [9, 5])
    assert dec.submit(first) == []
    done = dec.submit(second, beside=False)
    assert [got for got, _ in done] == [first, second] and dec.in_flight == 0
    assert not any(dec.busy(w.stream) for _, _, w in first + second)
    assert where[0].startswith("chattts-audio") and where[1:] == [threading.main_thread().name] * 2
    want = decode_module.decode_windows(model, [w for _, _, w in first + second])
    for a, b in zip(want, [x for _, audio in done for x in audio], strict=True):
        np.testing.assert_array_equal(b, a)
    dec.close()


def test_an_error_on_the_engine_thread_fails_that_submission_only(model, monkeypatch):
    """A decode that fails on the engine thread (``beside=False``) fails its own windows, as on the worker; the
    worker's earlier submission, collected first, keeps its audio."""
    from chattts_serve.audio import overlap as overlap_module

    real = overlap_module.decode_on_device

    def broken(model, windows, *args, **kw):
        if threading.current_thread() is threading.main_thread():
            raise RuntimeError("engine thread broke")
        return real(model, windows, *args, **kw)

    monkeypatch.setattr(overlap_module, "decode_on_device", broken)
    dec = AudioDecoder(model, torch.device("cpu"), "fp32", overlap=True, buckets=False, streams=ThreadStreams(1))
    first, second = _entries(model, [7]), _entries(model, [5, 6])
    assert dec.submit(first) == []
    (got1, audio1), (got2, audio2) = dec.submit(second, beside=False)
    assert got1 == first and audio1[0].shape == (512 * 7 - 256,)
    assert got2 == second and [str(a) for a in audio2] == ["engine thread broke"] * 2
    assert dec.in_flight == 0 and not any(dec.busy(w.stream) for _, _, w in first + second)
    dec.close()


def test_an_error_on_the_worker_fails_its_submission_only(model, monkeypatch):
    from chattts_serve.audio import overlap as overlap_module

    real = overlap_module.decode_on_device

    def broken(model, windows, *args, **kw):
        if len(windows) == 2:
            raise RuntimeError("worker broke")
        return real(model, windows, *args, **kw)

    monkeypatch.setattr(overlap_module, "decode_on_device", broken)
    dec = AudioDecoder(model, torch.device("cpu"), "fp32", overlap=True, buckets=False, streams=ThreadStreams(1))
    first, second = _entries(model, [5, 6]), _entries(model, [7])
    dec.submit(first)
    dec.submit(second)
    (got1, audio1), (got2, audio2) = dec.collect(wait=True)
    assert got1 == first and [str(a) for a in audio1] == ["worker broke"] * 2
    assert got2 == second and audio2[0].shape == (512 * 7 - 256,)
    assert not any(dec.busy(w.stream) for _, _, w in first + second)
    dec.close()


def _engine(tiny_ckpt, overlap: str, audio_dtype: str = "auto"):
    from chattts_serve import Engine
    from chattts_serve.engine.config import EngineConfig

    config = EngineConfig.with_slots(4, audio_overlap=overlap, audio_dtype=audio_dtype)
    return Engine.from_pretrained(tiny_ckpt, device="cpu", config=config)


@pytest.mark.parametrize("audio_dtype", ["fp32", "bf16", pytest.param("ov-bf16", marks=pytest.mark.slow)])
def test_a_cpu_worker_gives_every_stream_and_text_the_inline_audio_bit_for_bit(tiny_ckpt, monkeypatch, audio_dtype):
    """Overlap on a CPU (the worker thread; exact-length windows, the CPU's default) against the inline decode:
    the same codes and the same audio to the bit, streaming (several streams at once, windows left in flight
    across steps) and offline (texts of different lengths: their one-shot windows come at different steps).
    torch's decode and an OpenVINO graph (its own thread pool, called from the worker)."""
    from chattts_serve import SamplingParams

    if audio_dtype.startswith("ov-"):
        pytest.importorskip("openvino")

    texts = ["今天天气真不错。", "你好。", "我们一起去公园散步吧。"]
    where: set[str] = set()
    real = decode_module._decode_batch

    def recorded(*a):
        if threading.current_thread() not in _EARLIER:  # not another test's engine still running here
            where.add(threading.current_thread().name[:13])
        return real(*a)

    monkeypatch.setattr(decode_module, "_decode_batch", recorded)
    stream, offline = {}, {}
    for mode in ("off", "on"):
        engine = _engine(tiny_ckpt, mode, audio_dtype)
        assert isinstance(engine.core.stage.decoder.streams, ThreadStreams if mode == "on" else InlineStreams)
        if mode == "on":  # the plan's count for the worker (engine.plan: within the cores beside OpenMP)
            assert engine.core.stage.decoder.streams.threads == engine.runner.plan.audio_threads
        stream[mode] = _stream_run(engine, texts)
        params = [SamplingParams(seed=3, refine_text=False, min_new_tokens=n, max_new_tokens=n) for n in (30, 45, 60)]
        offline[mode] = engine.synthesize(texts, params)
        engine.close()
    assert where == {"MainThread", "chattts-audio"} and not _audio_threads()
    (want, want_final, inline), (got, got_final, deferred) = stream["off"], stream["on"]
    assert inline == 0 and deferred >= 1
    for rid in want:
        for a, b in zip(got_final[rid].segments, want_final[rid].segments, strict=True):
            np.testing.assert_array_equal(a.codes, b.codes)
        assert got[rid].size > 0
        np.testing.assert_array_equal(got[rid], want[rid], err_msg=rid)
    for a, b in zip(offline["on"], offline["off"], strict=True):
        np.testing.assert_array_equal(a.codes, b.codes)
        np.testing.assert_array_equal(a.audio, b.audio)


def _one_shot_core(engine, lengths: dict[str, int]):
    from chattts_serve import SamplingParams
    from chattts_serve.audio.policy import StreamPolicy

    core = engine.core
    for rid, n in lengths.items():
        p = SamplingParams(seed=7, refine_text=False, min_new_tokens=n, max_new_tokens=n)
        core.add_request(rid, core.prepare("今天天气真不错。", p), StreamPolicy.one_shot())
    return core


def _drain(core, on_step=None) -> dict:
    audio, finals = {}, {}
    for step in range(2000):
        if not core.has_unfinished():
            break
        if on_step is not None:
            on_step(step)
        for out in core.step():
            audio.setdefault(out.request_id, []).append(out.audio)
            if out.finished:
                finals[out.request_id] = (out, np.concatenate(audio[out.request_id]))
    assert not core.has_unfinished()
    return finals


def test_a_window_that_fails_on_the_worker_fails_its_request_and_the_engine_serves_on(tiny_ckpt, monkeypatch):
    real = decode_module._decode_batch

    def fail_45(model, h, *rest):
        if h.shape[1] == 45:  # the one-shot window of r1 (its own length: a batch of its own)
            raise ValueError("bad window")
        return real(model, h, *rest)

    engine = _engine(tiny_ckpt, "on")
    want = _drain(_one_shot_core(engine, {"r0": 30, "r2": 60}))
    monkeypatch.setattr(decode_module, "_decode_batch", fail_45)
    got = _drain(_one_shot_core(engine, {"r0": 30, "r1": 45, "r2": 60}))
    assert got["r1"][0].finish_reason == "error" and "bad window" in got["r1"][0].error
    for rid in ("r0", "r2"):
        assert got[rid][0].finish_reason == "length"
        np.testing.assert_array_equal(got[rid][1], want[rid][1])
    after = _drain(_one_shot_core(engine, {"r3": 20}))  # the worker and the engine go on
    assert after["r3"][0].finish_reason == "length" and after["r3"][1].shape == (512 * 20 - 256,)
    engine.close()
    assert not _audio_threads()


def test_aborting_a_request_whose_window_is_on_the_worker_leaves_the_others_whole(tiny_ckpt, monkeypatch):
    gate = threading.Event()
    real = decode_module._decode_batch

    def held(*args):
        if threading.current_thread() is not threading.main_thread():
            assert gate.wait(60)
        return real(*args)

    engine = _engine(tiny_ckpt, "on")
    want = _drain(_one_shot_core(engine, {"r0": 30, "r1": 45}))
    monkeypatch.setattr(decode_module, "_decode_batch", held)
    core = _one_shot_core(engine, {"r0": 30, "r1": 45})
    aborted = []

    def abort_in_flight(step):
        dec = core.stage.decoder
        if not aborted and dec.in_flight:  # r0's window is held on the worker
            [entries] = [p.entries for p in dec._pending]
            assert [rid for rid, _, _ in entries] == ["r0"]
            aborted.append(core.abort("r0"))
            gate.set()

    got = _drain(core, abort_in_flight)
    assert aborted == [True] and got["r0"][0].finish_reason == "aborted"
    assert got["r1"][0].finish_reason == "length"
    np.testing.assert_array_equal(got["r1"][1], want["r1"][1])
    dec = core.stage.decoder
    assert dec.in_flight == 0 and not dec._busy
    engine.close()
    assert not _audio_threads()


def test_the_async_engine_joins_the_worker_when_it_shuts_down(tiny_ckpt):
    import asyncio

    from chattts_serve import SamplingParams
    from chattts_serve.engine.async_engine import AsyncEngine
    from chattts_serve.engine.config import EngineConfig

    engine = AsyncEngine.from_pretrained(tiny_ckpt, config=EngineConfig.with_slots(2, audio_overlap="on"))
    engine.start()
    alive: list[int] = []

    async def stream():
        p = SamplingParams(seed=1, refine_text=False, min_new_tokens=40, max_new_tokens=40)
        chunks = []
        async for chunk in engine.stream("今天天气真不错。", p):
            alive.append(len(_audio_threads()))
            chunks.append(chunk)
        return chunks

    try:
        chunks = asyncio.run(asyncio.wait_for(stream(), 120))
    finally:
        engine.shutdown()
    assert chunks[-1].finished and sum(len(c.audio) for c in chunks) == 512 * 40 - 256
    assert max(alive) == 1  # the decode ran on the worker
    assert not _audio_threads()
