"""AsyncEngine: streaming, generate, abort on early exit, queue bound, slow consumers, shutdown."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from chattts_serve import Engine, SamplingParams
from chattts_serve.audio.policy import StreamPolicy
from chattts_serve.engine.async_engine import AsyncEngine, EngineDeadError, EngineError
from chattts_serve.engine.config import EngineConfig
from chattts_serve.engine.scheduler import QueueFullError, SchedulerConfig

TEXT = "今天天气真不错，我们一起去公园散步吧。"


def p(seed: int, n: int = 60, **kw) -> SamplingParams:
    return SamplingParams(seed=seed, max_new_tokens=n, refine_text=False, **kw)


@pytest.fixture(scope="module")
def aengine(tiny_ckpt):
    engine = AsyncEngine.from_pretrained(tiny_ckpt, config=EngineConfig(scheduler=SchedulerConfig(max_num_seqs=4)))
    yield engine
    engine.shutdown()


def run(coro, timeout: float = 120):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def collect(engine: AsyncEngine, text: str, params: SamplingParams, **kw):
    return [c async for c in engine.stream(text, params, **kw)]


def test_stream_chunks_are_contiguous_and_complete(aengine):
    chunks = run(collect(aengine, TEXT, p(1, 80)))
    assert chunks[-1].finished and chunks[-1].finish_reason in ("stop", "length")
    assert all(not c.finished for c in chunks[:-1])
    assert [c.index for c in chunks] == list(range(len(chunks)))
    starts = np.cumsum([0] + [len(c.audio) for c in chunks[:-1]])
    assert [c.start_sample for c in chunks] == starts.tolist()
    steps = len(chunks[-1].segments[0].codes)
    assert sum(len(c.audio) for c in chunks) == 512 * steps - 256
    first = StreamPolicy().first_chunk
    if steps >= first + StreamPolicy().lookahead:  # the first chunk is small (fast first audio)
        assert len(chunks[0].audio) == first * 512
    assert all(c.audio.dtype == np.float32 for c in chunks)
    elapsed = [c.elapsed_s for c in chunks]
    assert elapsed == sorted(elapsed)


def test_stream_codes_equal_offline_engine(aengine, tiny_ckpt):
    offline = Engine.from_pretrained(tiny_ckpt, config=EngineConfig.with_slots(4))
    [ref] = offline.synthesize(TEXT, p(2, 70))
    chunks = run(collect(aengine, TEXT, p(2, 70)))
    np.testing.assert_array_equal(chunks[-1].segments[0].codes, ref.codes)
    streamed = np.concatenate([c.audio for c in chunks])
    assert len(streamed) == len(ref.audio)
    noise = np.sum((streamed - ref.audio) ** 2)
    assert 10 * np.log10(np.sum(ref.audio**2) / max(noise, 1e-30)) > 40


def test_generate_returns_whole_audio(aengine):
    result = run(aengine.generate(TEXT, p(3, 50)))
    assert result.finish_reason in ("stop", "length")
    assert len(result.audio) == 512 * len(result.codes) - 256
    assert result.time_to_first_audio_s is not None and result.elapsed_s >= result.time_to_first_audio_s


def test_concurrent_streams_match_alone(aengine):
    async def many():
        return await asyncio.gather(*(collect(aengine, TEXT, p(10 + i, 40 + 10 * i)) for i in range(6)))

    together = run(many())
    for i, chunks in enumerate(together):
        alone = run(collect(aengine, TEXT, p(10 + i, 40 + 10 * i)))
        np.testing.assert_array_equal(chunks[-1].segments[0].codes, alone[-1].segments[0].codes)


def test_bad_input_raises_before_submission(aengine):
    async def first(text, params):
        async for _ in aengine.stream(text, params):
            break

    with pytest.raises(ValueError, match="empty"):
        run(first("   ", p(1)))
    with pytest.raises(ValueError, match="unknown control token"):
        run(first("你好", p(1, prompt="[nope]")))
    with pytest.raises(ValueError):
        run(first("你好", p(1, speaker="not a speaker")))
    assert aengine.is_running


def test_breaking_out_aborts_and_frees_the_slot(aengine):
    async def scenario():
        other = asyncio.create_task(collect(aengine, TEXT, p(20, 120)))
        async for chunk in aengine.stream(TEXT, p(21, 400), request_id="to-abort"):
            assert chunk.index == 0
            break
        for _ in range(200):
            await asyncio.sleep(0.02)
            if not aengine.core.has_request("to-abort") and aengine.stats().num_running <= 1:
                break
        assert not aengine.core.has_request("to-abort")
        return await other

    other = run(scenario())
    alone = run(collect(aengine, TEXT, p(20, 120)))
    np.testing.assert_array_equal(other[-1].segments[0].codes, alone[-1].segments[0].codes)


def test_slow_consumer_does_not_stall_others(aengine):
    async def scenario():
        async def slow():
            chunks = []
            async for c in aengine.stream(TEXT, p(30, 150)):
                chunks.append((c, time.monotonic()))
                await asyncio.sleep(1.0)
            return chunks

        async def fast():
            chunks = await collect(aengine, TEXT, p(31, 60))
            return chunks, time.monotonic()

        return await asyncio.gather(slow(), fast())

    slow_chunks, (fast_chunks, fast_done) = run(scenario())
    assert fast_done < slow_chunks[-1][1]  # the fast one finished while the slow one was sleeping
    total = sum(len(c.audio) for c, _ in slow_chunks)
    assert total == 512 * len(slow_chunks[-1][0].segments[0].codes) - 256  # merged, nothing lost


def test_model_work_never_runs_on_the_event_loop(aengine):
    """The model (steps, normalisation, tokenising) runs in the engine thread and worker threads, never
    in the event loop's thread, so the loop stays free for other clients whatever the model costs.
    Checked by where the work runs, not by timing it."""
    threads: set[int] = set()
    step, prepare = aengine.core.step, aengine.core.prepare

    def recording_step():
        threads.add(threading.get_ident())
        return step()

    def recording_prepare(*a, **kw):
        threads.add(threading.get_ident())
        return prepare(*a, **kw)

    aengine.core.step, aengine.core.prepare = recording_step, recording_prepare

    async def scenario():
        await collect(aengine, TEXT, p(40, 150))
        return threading.get_ident()

    try:
        loop_thread = run(scenario())
    finally:
        aengine.core.step, aengine.core.prepare = step, prepare
    assert threads and loop_thread not in threads


def test_the_building_thread_gives_up_its_openmp_pool(tiny_engine, monkeypatch):
    """The loop thread steps from construction on: the thread that built the engine frees its OpenMP pool
    there (``openmp``: two pools on 2 CPUs throttle every barrier of every step)."""
    from chattts_serve import openmp

    calls: list[int] = []
    monkeypatch.setattr(openmp, "release_pool", lambda: calls.append(threading.get_ident()) or True)
    engine = AsyncEngine(tiny_engine)
    try:
        assert calls == [threading.get_ident()]
    finally:
        engine.shutdown()


def test_queue_full_is_refused(tiny_ckpt):
    engine = AsyncEngine.from_pretrained(
        tiny_ckpt, config=EngineConfig(scheduler=SchedulerConfig(max_num_seqs=1, max_waiting=2))
    )

    async def scenario():
        tasks = []
        for i in range(3):  # one runs, two wait: the queue is at its bound
            tasks.append(asyncio.create_task(collect(engine, TEXT, p(50 + i, 200))))
            await asyncio.sleep(0.05)
        with pytest.raises(QueueFullError):
            await collect(engine, TEXT, p(60, 10))
        return await asyncio.gather(*tasks)

    try:
        results = run(scenario())
        assert all(r[-1].finished for r in results)  # the accepted ones complete
    finally:
        engine.shutdown()


def test_shutdown_then_submit_raises(tiny_ckpt):
    engine = AsyncEngine.from_pretrained(tiny_ckpt, config=EngineConfig(scheduler=SchedulerConfig(max_num_seqs=2)))
    run(collect(engine, TEXT, p(1, 20)))
    engine.shutdown()
    with pytest.raises(EngineDeadError):
        run(collect(engine, TEXT, p(1, 20)))


def test_custom_stream_policy(aengine):
    chunks = run(collect(aengine, TEXT, p(5, 100), policy=StreamPolicy(first_chunk=4, max_chunk=8, lookahead=4)))
    sizes = [len(c.audio) // 512 for c in chunks[:-1]]
    assert sizes[:2] == [4, 8] and all(s == 8 for s in sizes[1:])


def test_a_consumer_that_stops_reading_is_cut_off(tiny_ckpt):
    """Audio piles up for a consumer that stopped reading; past max_buffered_audio_s the request is
    aborted (its slot and memory come back) and the consumer, if it ever reads again, gets an error."""
    from chattts_serve.engine.async_engine import SlowConsumerError

    engine = AsyncEngine.from_pretrained(tiny_ckpt, config=EngineConfig.with_slots(1), max_buffered_audio_s=0.5)

    async def scenario():
        stream = engine.stream(TEXT, p(1, 400, min_new_tokens=400))  # 8.5 s of audio, far past the 0.5 s allowed
        first = await anext(stream)
        assert first.index == 0
        for _ in range(1200):  # stop reading until the engine has let go of the request
            if not engine.core.has_unfinished():
                break
            await asyncio.sleep(0.05)
        assert not engine.core.has_unfinished()
        with pytest.raises(SlowConsumerError):
            async for _ in stream:
                pass

    try:
        run(scenario())
        assert engine.stats().kv_slots_used == 0
        chunks = run(collect(engine, TEXT, p(2, 20)))  # the engine serves on
        assert chunks[-1].finished and chunks[-1].finish_reason in ("stop", "length")
    finally:
        engine.shutdown()


def test_a_step_that_fails_after_ending_a_request_fails_it_instead_of_leaving_it_waiting(aengine):
    # The step makes the request's final output, then raises: the output is lost with the step, and the
    # reset that follows no longer holds the request. Its client gets the error (not a stream that never
    # ends), and the engine serves on.
    step, raised = aengine.core.step, []

    def step_then_fail():
        outputs = step()
        if any(out.finished for out in outputs) and not raised:
            raised.append(True)
            raise RuntimeError("after the outputs")
        return outputs

    aengine.core.step = step_then_fail
    try:
        with pytest.raises(EngineError, match="engine step failed"):
            run(collect(aengine, TEXT, p(3, 20)), timeout=60)
    finally:
        aengine.core.step = step
    assert raised
    assert run(collect(aengine, TEXT, p(4, 20)))[-1].finished
