"""A code pass whose prompt outgrows a slot (the refine pass's text, the first sentence's voice sample)
is spoken in parts (engine/pipeline.py with engine/prompt_fit.py), end to end on the tiny checkpoint.
Small ``max_model_len`` values stand in for the full model's long prompts; min_new_tokens ==
max_new_tokens fixes lengths (the tiny checkpoint's EOS comes from random weights)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from chattts_serve import Engine, RefineParams, SamplingParams
from chattts_serve.engine import runner
from chattts_serve.engine.config import EngineConfig
from chattts_serve.engine.scheduler import SchedulerConfig
from chattts_serve.models.chattts.tokenizer import code_prompt

VOICE_TEXT = "今天天气不错。我们去公园。"
REFINE_TEXT = "第一句。第二句。Third one."


def engine(ckpt, max_model_len: int) -> Engine:
    config = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=4, max_model_len=max_model_len))
    return Engine.from_pretrained(ckpt, device="cpu", config=config)


def voice_lengthened(tokens: int = 100) -> SamplingParams:
    """Two sentences: the first one's voice sample (``tokens`` codes) lengthens both passes' prompts."""
    return SamplingParams(seed=9, refine_text=False, min_new_tokens=tokens, max_new_tokens=tokens)


def refined() -> SamplingParams:
    """The refine pass writes 150 tokens per sentence: prompts of ~170 (and the voice sample's 60 more)."""
    return SamplingParams(
        seed=5, min_new_tokens=60, max_new_tokens=60, refine=RefineParams(min_new_tokens=150, max_new_tokens=150)
    )


def no_errors(caplog) -> None:
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_voice_lengthened_prompts_are_spoken_in_parts(tiny_ckpt, caplog):
    """Each later pass: 19 positions of text and template + 100 of sample + 100 to generate > 200."""
    caplog.set_level(logging.WARNING)
    [r] = engine(tiny_ckpt, 200).synthesize(VOICE_TEXT, voice_lengthened())
    assert r.finish_reason == "length" and len(r.audio) > 0
    assert [s.codes.shape for s in r.segments] == [(100, 4), (100, 4)]  # a split sentence: its parts' codes
    no_errors(caplog)


def test_refined_prompts_are_spoken_in_parts(tiny_ckpt, caplog):
    caplog.set_level(logging.WARNING)
    [r] = engine(tiny_ckpt, 260).synthesize(REFINE_TEXT, refined())
    assert r.finish_reason == "length" and len(r.audio) > 0
    assert [s.codes.shape for s in r.segments] == [(60, 4)] * 3
    no_errors(caplog)


def test_a_pass_that_fits_exactly_is_spoken_as_before(tiny_ckpt):
    """prompt + max_new_tokens == max_model_len: one pass, the same codes and audio as with room to spare."""
    text, params = "今天天气不错。", SamplingParams(seed=3, refine_text=False, min_new_tokens=30, max_new_tokens=30)
    roomy = engine(tiny_ckpt, 4096)
    prompt = len(roomy.tokenizer.encode(code_prompt(text, params.prompt, False)))
    [a] = roomy.synthesize(text, params)
    [b] = engine(tiny_ckpt, prompt + 30).synthesize(text, params)
    np.testing.assert_array_equal(a.codes, b.codes)
    np.testing.assert_array_equal(a.audio, b.audio)
    [c] = engine(tiny_ckpt, prompt + 29).synthesize(text, params)  # one position less: cut, as long in all
    assert c.codes.shape == (30, 4) and len(c.segments) == 1


def test_a_request_no_split_can_fit_is_refused_before_it_runs(tiny_ckpt, caplog):
    """min_new_tokens alone past the slot: a ValueError at once (a 400), even with the refine pass on
    (it used to run the refine pass, then fail)."""
    caplog.set_level(logging.WARNING)
    eng = engine(tiny_ckpt, 200)
    params = SamplingParams(seed=1, min_new_tokens=300, max_new_tokens=300, refine=RefineParams(max_new_tokens=8))
    with pytest.raises(ValueError, match=r"max_model_len of 200 positions: min_new_tokens 300"):
        eng.synthesize(REFINE_TEXT, params)
    assert not eng.core.scheduler.has_unfinished()
    no_errors(caplog)


def test_max_model_len_defaults_to_the_checkpoint_positions_and_not_beyond(tiny_ckpt):
    assert SchedulerConfig().max_model_len == 4096
    with pytest.raises(ValueError, match="max_position_embeddings"):
        engine(tiny_ckpt, 4097)


def test_fixed_slots_get_the_length_memory_holds(tiny_ckpt, monkeypatch):
    eng = engine(tiny_ckpt, 4096)
    model, dtype = eng.model, eng.core.stage.runner.cache.k.dtype
    slot_3000 = runner.slot_bytes(model.config.gpt, 3000, dtype)
    monkeypatch.setattr(runner, "free_bytes", lambda device: 2 * 16 * slot_3000)  # half: 16 x 3000
    assert runner.fitted_model_len(model, 16, 4096, eng.device, dtype, fraction=0.5) == 3000
    assert runner.fitted_model_len(model, 8, 4096, eng.device, dtype, fraction=0.5) == 4096
    monkeypatch.setattr(runner, "free_bytes", lambda device: 0)  # never below the old default
    assert runner.fitted_model_len(model, 16, 4096, eng.device, dtype, fraction=0.5) == 2304


@pytest.mark.slow
def test_the_issue_example_fits_the_default_slot(tiny_ckpt, caplog):
    """Issue 29's example at full length: a 2000-code voice sample and 2000 more per sentence need ~4020
    positions, which the old 2304-position slot could not hold and the checkpoint's 4096 do."""
    caplog.set_level(logging.WARNING)
    eng = Engine.from_pretrained(tiny_ckpt, device="cpu", config=EngineConfig.with_slots(2))
    [r] = eng.synthesize(VOICE_TEXT, voice_lengthened(2000))
    assert [s.codes.shape for s in r.segments] == [(2000, 4), (2000, 4)]
    no_errors(caplog)


def test_a_refined_text_too_long_for_any_split_is_spoken_unrefined(tiny_ckpt, monkeypatch, caplog):
    """The refine pass writes a text (patched: 16 slots' worth of characters without a mark) that no 16 parts
    fit: the sentence is spoken as normalised, said in an INFO line and in the result, never an error."""
    caplog.set_level(logging.INFO)
    eng = engine(tiny_ckpt, 128)
    monkeypatch.setattr(eng.core.stage.pipeline.tokenizer, "decode", lambda ids: "啊" * 16 * 128)
    params = SamplingParams(seed=5, min_new_tokens=20, max_new_tokens=20, refine=RefineParams(max_new_tokens=4))
    [r] = eng.synthesize(REFINE_TEXT, params)
    assert r.finish_reason == "length" and len(r.audio) > 0
    assert [s.unrefined for s in r.segments] == [True] * 3
    assert "啊" not in "".join(r.text) and r.text[0].startswith("第一句")
    assert "speaking its unrefined text" in caplog.text
    assert not [rec for rec in caplog.records if rec.levelno >= logging.WARNING], caplog.text


def test_a_sentence_no_slot_holds_even_unrefined_is_the_clients_error(tiny_ckpt, monkeypatch, caplog):
    """No split fits (patched fitter) once the refine pass has run: a ValueError (a 400 on the server), no
    ERROR line, and the engine serves on."""
    from chattts_serve.engine import pipeline

    caplog.set_level(logging.INFO)
    eng = engine(tiny_ckpt, 128)
    monkeypatch.setattr(pipeline, "fit", lambda *a, **kw: None)
    params = SamplingParams(seed=5, min_new_tokens=8, max_new_tokens=8, refine=RefineParams(max_new_tokens=4))
    with pytest.raises(ValueError, match="does not fit a slot"):
        eng.synthesize(REFINE_TEXT, params)
    no_errors(caplog)
    monkeypatch.undo()
    assert eng.synthesize("你好。", params)[0].finish_reason == "length"
