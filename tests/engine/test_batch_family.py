"""A "batch" model family through the engine (``engine.batch.BatchStage``, admission by work budget), with the
test-only sine family (tests/support/sine_family.py): its rate, its voices, its options, batching across
requests and cancellation."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from chattts_serve import SamplingParams
from chattts_serve.engine.async_engine import AsyncEngine
from chattts_serve.engine.config import EngineConfig
from chattts_serve.engine.engine import Engine
from chattts_serve.engine.scheduler import SchedulerConfig
from tests.support.sine_family import FRAME, RATE, registered

TEXT = "One two three. Four five!"
WORDS = ("One", "two", "three.", "Four", "five!")


@pytest.fixture
def sine_dir(tmp_path):
    with registered() as family:
        yield family.write_random(tmp_path / "sine")


def engine_on(root, **scheduler) -> Engine:
    config = EngineConfig(scheduler=SchedulerConfig(**scheduler)) if scheduler else None
    return Engine.from_pretrained(root, config=config)


def samples(words, speed: float = 1.0) -> int:
    return sum(max(1, round((2 + len(w)) / speed)) * FRAME for w in words)


def test_the_engine_takes_the_family_its_rate_and_its_shape(sine_dir):
    engine = engine_on(sine_dir)
    assert engine.family.name == "sine" and engine.sample_rate == RATE
    assert engine.core.scheduler.config.admission == "work"
    [result] = engine.synthesize(TEXT, SamplingParams(seed=1))
    assert result.sample_rate == RATE and len(result.audio) == samples(WORDS)
    assert result.duration == len(result.audio) / RATE
    assert result.text == ["One two three.", "Four five!"] and result.finish_reason == "stop"
    first, second = result.spans
    assert (first.start, first.end, second.end) == (0, samples(WORDS[:3]), samples(WORDS))
    assert first.sample_rate == RATE and second.start_s == samples(WORDS[:3]) / RATE
    assert [w.text for w in second.words] == ["Four", "five!"] and second.words[0].start == first.end
    assert result.num_input_tokens == 5


def test_chattts_only_accessors_say_so(sine_dir):
    engine = engine_on(sine_dir)
    with pytest.raises(ValueError, match="the tokenizer is ChatTTS's; this engine serves a sine model"):
        engine.tokenizer  # noqa: B018
    with pytest.raises(ValueError, match="ChatTTS's"):
        engine.sample_speaker(1)


def test_voices_and_the_family_option(sine_dir):
    engine = engine_on(sine_dir)
    low, high = engine.synthesize(
        ["One.", "One."], [SamplingParams(), SamplingParams(speaker=engine.voices.voice("high"))]
    )
    assert len(low.audio) == len(high.audio) and not np.allclose(low.audio, high.audio)
    assert engine.voices.blend(["hz:200", "hz:400"], [1, 3]) == "hz:350"
    [fast] = engine.synthesize("One two three.", SamplingParams(options={"speed": 2.0}))
    assert len(fast.audio) == samples(WORDS[:3], 2.0) < samples(WORDS[:3])


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (SamplingParams(refine_text=False), "option 'refine_text' belongs to the chattts family; this model is a sine"),
        (SamplingParams(temperature=0.5), "option 'temperature' belongs to the chattts family"),
        (SamplingParams(prompt="[speed_2]"), "option 'prompt' belongs to the chattts family"),
        (SamplingParams(options={"pitch": 3}), "unknown sine option"),
        (SamplingParams(options={"speed": 9.0}), "speed must be a number in 0.25..4"),
        (SamplingParams(speaker="hz:5"), "a sine voice is"),
    ],
)
def test_bad_options_are_refused_before_any_compute(sine_dir, params, message):
    engine = engine_on(sine_dir)
    with pytest.raises(ValueError, match=message):
        engine.synthesize("One.", params)
    assert engine.family_model.batches == []


def test_chattts_refuses_another_familys_options(tiny_engine):
    with pytest.raises(ValueError, match="speed are not ChatTTS's"):
        tiny_engine.synthesize("你好。", SamplingParams(seed=1, options={"speed": 1.5}))


def test_requests_share_batches_within_the_work_budget(sine_dir):
    """Five requests of two sentences (2-3 ids each): with a budget of 8 ids a step runs whole utterances of
    several requests together, never more than 8 ids (but always at least one utterance)."""
    engine = engine_on(sine_dir, max_batch_work=8)
    texts = [f"{TEXT} Six{'!' * i}" for i in range(5)]
    results = engine.synthesize(texts, SamplingParams(seed=3))
    model = engine.family_model
    assert sum(model.batches) == 15 and max(model.batches) >= 3 and len(model.batches) < 15
    alone = [engine.synthesize(t, SamplingParams(seed=3))[0] for t in texts]
    for r, a in zip(results, alone, strict=True):  # a request's audio does not depend on its batch
        np.testing.assert_array_equal(r.audio, a.audio)


def test_rows_per_batch_follow_max_num_seqs(sine_dir):
    engine = engine_on(sine_dir, max_num_seqs=2, max_batch_work=1000)
    engine.synthesize(["A. B. C.", "D. E."], SamplingParams())
    assert engine.family_model.batches == [2, 2, 1]


def test_an_utterance_over_the_budget_is_refused(sine_dir):
    engine = engine_on(sine_dir, max_batch_work=2)
    with pytest.raises(ValueError, match="exceeds max_batch_work"):
        engine.synthesize("one two three.", SamplingParams())


def test_a_failed_batch_fails_its_requests_and_the_engine_serves_on(sine_dir, monkeypatch):
    engine = engine_on(sine_dir)
    model = engine.family_model

    def boom(batch):
        raise RuntimeError("device lost")

    monkeypatch.setattr(model, "synthesize", boom)
    with pytest.raises(RuntimeError, match="model step failed: device lost"):
        engine.synthesize("One.", SamplingParams())
    monkeypatch.undo()
    assert len(engine.synthesize("One.", SamplingParams())[0].audio) == samples(["One."])


def test_a_cancelled_stream_leaves_before_its_utterances_run_and_the_others_complete(sine_dir):
    """Through ``AsyncEngine``, one utterance per batch: while the first request's first batch is held, a second
    request is submitted and its consumer goes away (a client gone); it is aborted, none of its utterances
    runs, the first request completes, and nothing is left running."""
    engine = AsyncEngine(engine_on(sine_dir, max_num_seqs=1))
    model = engine.engine.family_model
    model.gate = threading.Semaphore(0)

    async def main():
        kept = asyncio.create_task(engine.generate(TEXT, SamplingParams()))
        while engine.stats().num_running == 0:  # its first utterance is in the held batch
            await asyncio.sleep(0.01)
        gone = asyncio.create_task(engine.generate("Six seven. Eight nine.", SamplingParams()))
        while len(engine._collectors) < 2:  # submitted: in the engine loop's inbox behind the held step
            await asyncio.sleep(0.01)
        gone.cancel()  # its abort follows it into the inbox once the task has unwound
        await asyncio.gather(gone, return_exceptions=True)  # released before that, the engine could run it
        model.gate.release(10)
        result = await asyncio.wait_for(kept, 30)
        while engine.core.has_unfinished():
            await asyncio.sleep(0.01)
        return result

    try:
        result = asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        engine.shutdown()
    assert len(result.audio) == samples(WORDS) and result.sample_rate == RATE
    assert model.batches == [1, 1]  # kept's two sentences; none of gone's
    assert engine.stats().num_waiting == 0 and engine.stats().num_running == 0


def test_every_streamed_delta_says_the_models_rate(sine_dir):
    """One sentence per batch, the second held until the first delta is read: a delta before the last."""
    engine = AsyncEngine(engine_on(sine_dir, max_num_seqs=1))
    model = engine.engine.family_model
    model.gate = threading.Semaphore(1)

    async def main():
        chunks = []
        async for chunk in engine.stream(TEXT, SamplingParams()):
            chunks.append(chunk)
            model.gate.release()
        return chunks

    try:
        chunks = asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        engine.shutdown()
    assert len(chunks) == 2 and not chunks[0].finished and {c.sample_rate for c in chunks} == {RATE}


def test_a_batch_familys_audio_stops_at_the_requests_budget(sine_dir):
    """A batch family's durations are known only after its model ran: the audio past ``max_audio_seconds`` is
    cut, the sentences after it never run, and the request ends with "length" (issue 29's principle: one
    request's limits hold for any family)."""
    text = "One two three. Four five! Six seven. Eight nine ten."
    whole = samples(("One", "two", "three.", "Four", "five!", "Six", "seven.", "Eight", "nine", "ten."))
    budget = samples(WORDS) + FRAME  # the first two sentences and one frame of the third
    config = EngineConfig(
        max_audio_seconds=budget / RATE, scheduler=SchedulerConfig(max_batch_work=3, max_num_seqs=4)
    )
    engine = Engine.from_pretrained(sine_dir, config=config)
    [result] = engine.synthesize(text, SamplingParams(seed=1))
    assert whole > budget and len(result.audio) == budget
    assert result.finish_reason == "length" and len(result.spans) == 3 and result.spans[-1].end == budget
    assert all(w.end <= budget for span in result.spans for w in span.words)
    ran = sum(engine.core.stage.model.batches)
    assert ran < 4  # the fourth sentence was never synthesised
    assert not engine.core.has_unfinished()
    # A tighter budget given with the request (the server's per-request share) is the one held.
    assert engine.core.prepare("One.", SamplingParams(), max_audio_seconds=FRAME / RATE).max_samples == FRAME
    assert engine.core.prepare("One.", SamplingParams()).max_samples == budget
