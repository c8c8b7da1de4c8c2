"""engine/engine.py end to end on the tiny random checkpoint (session fixture ``tiny_engine``)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from chattts_serve import RefineParams, Result, SamplingParams
from chattts_serve.models.chattts.config import SAMPLE_RATE
from chattts_serve.models.chattts.speaker import (
    decode_prompt_codes,
    decode_speaker,
    encode_prompt_codes,
    encode_speaker,
)

SHORT = 24  # max_new_tokens for most runs
FAST_REFINE = RefineParams(max_new_tokens=8)


def params(**kw) -> SamplingParams:
    base = dict(seed=1, max_new_tokens=SHORT, refine_text=False, refine=FAST_REFINE)
    base.update(kw)
    return SamplingParams(**base)


def synth(engine, texts, **kw) -> list[Result]:
    return engine.synthesize(texts, params(**kw))


# ---------------------------------------------------------------- shapes and lengths


def test_single_text_result(tiny_engine):
    [r] = synth(tiny_engine, "你好。")
    assert isinstance(r, Result)
    assert r.sample_rate == SAMPLE_RATE
    assert r.audio.dtype == np.float32 and r.audio.ndim == 1
    assert np.isfinite(r.audio).all()
    assert r.codes.dtype == np.int64 and r.codes.ndim == 2 and r.codes.shape[1] == 4
    n = r.codes.shape[0]
    assert 1 <= n <= SHORT
    assert len(r.audio) == 512 * n - 256
    assert r.duration == pytest.approx(len(r.audio) / SAMPLE_RATE)
    assert len(r.text) == len(r.finish_reasons) == 1
    assert r.finish_reasons[0] in ("stop", "length")


def test_codes_in_range(tiny_engine):
    for r in synth(tiny_engine, ["你好。", "今天天气很好。"], seed=3, temperature=1.0, top_p=1.0, top_k=0):
        assert ((r.codes >= 0) & (r.codes < 625)).all()


def test_min_equals_max_fixes_length(tiny_engine):
    for n in (1, 5, 17):
        [r] = synth(tiny_engine, "你好。", min_new_tokens=n, max_new_tokens=n)
        assert r.codes.shape == (n, 4)
        assert len(r.audio) == 512 * n - 256
        assert r.finish_reasons == ["length"]


def test_split_text_lengths_add_up_per_segment(tiny_engine):
    n = 6
    text = "今天天气很好。我们去公园散步吧。明天见。"
    [r] = synth(tiny_engine, text, min_new_tokens=n, max_new_tokens=n)
    segments = len(r.text)
    assert segments >= 2  # split into sentences
    assert len(r.finish_reasons) == segments
    assert r.codes.shape == (segments * n, 4)
    assert len(r.audio) == segments * (512 * n - 256)
    [whole] = synth(tiny_engine, text, min_new_tokens=n, max_new_tokens=n, split_text=False)
    assert len(whole.text) == 1 and len(whole.audio) == 512 * n - 256


def _assert_concatenation(r, parts):
    np.testing.assert_array_equal(r.codes, np.concatenate([p.codes for p in parts]))
    offs = 0
    for p in parts:
        np.testing.assert_allclose(r.audio[offs : offs + len(p.audio)], p.audio, atol=1e-6)
        offs += len(p.audio)
    assert offs == len(r.audio)


def test_split_segments_equal_separate_runs(tiny_engine):
    """Without the voice step each segment is generated and decoded on its own: the audio is the
    concatenation of the parts."""
    [r] = synth(tiny_engine, "今天天气很好。我们去公园散步吧。", max_new_tokens=10, first_sentence_voice=False)
    assert len(r.text) == 2 and r.voice_sample is None
    parts = synth(tiny_engine, r.text, max_new_tokens=10, do_text_normalization=False, split_text=False)
    _assert_concatenation(r, parts)


def test_voice_step_is_the_first_sentence_spoken_alone_then_used_as_sample(tiny_engine):
    """The reference's voice step, by hand through the public API: speak sentence 1 alone, take a voice
    sample from its audio, speak every sentence with that sample and sentence 1 as its transcript."""
    speaker = tiny_engine.sample_speaker(seed=3)
    text = "今天天气很好。我们去公园散步吧。明天见。"
    [r] = synth(tiny_engine, text, min_new_tokens=12, max_new_tokens=12, speaker=speaker)
    assert len(r.text) == 3 and r.voice_sample is not None
    [first] = synth(
        tiny_engine,
        r.text[0],
        min_new_tokens=12,
        max_new_tokens=12,
        speaker=speaker,
        do_text_normalization=False,
        split_text=False,
    )
    sample = tiny_engine.speaker_from_audio(first.audio)
    assert sample == r.voice_sample
    parts = synth(
        tiny_engine,
        r.text,
        min_new_tokens=12,
        max_new_tokens=12,
        speaker=speaker,
        do_text_normalization=False,
        split_text=False,
        speaker_sample=sample,
        speaker_sample_text=r.text[0],
    )
    _assert_concatenation(r, parts)
    # ... and it changes the speech: without it the codes differ.
    [plain] = synth(
        tiny_engine, text, min_new_tokens=12, max_new_tokens=12, speaker=speaker, first_sentence_voice=False
    )
    assert not np.array_equal(plain.codes, r.codes)


def test_voice_step_needs_several_sentences_and_no_sample(tiny_engine):
    [one] = synth(tiny_engine, "今天天气很好。", min_new_tokens=8, max_new_tokens=8)
    assert one.voice_sample is None  # one sentence: nothing to keep consistent
    sample = tiny_engine.speaker_from_audio(one.audio)  # 8 steps: enough audio for a sample
    [given] = synth(tiny_engine, "今天天气很好。明天见。", max_new_tokens=8, speaker_sample=sample)
    assert given.voice_sample is None  # the caller's sample wins
    [unsplit] = synth(tiny_engine, "今天天气很好。明天见。", max_new_tokens=8, split_text=False)
    assert unsplit.voice_sample is None and len(unsplit.text) == 1


def test_voice_step_with_refine_uses_the_refined_first_sentence(tiny_engine):
    text = "今天天气很好。我们去公园散步吧。"
    [r] = synth(
        tiny_engine,
        text,
        min_new_tokens=10,
        max_new_tokens=10,
        refine_text=True,
        refine=RefineParams(max_new_tokens=12),
    )
    assert len(r.text) == 2 and r.voice_sample is not None
    # The refined text is spoken as it is (not normalised again, homophones included), as the reference.
    [first] = synth(
        tiny_engine,
        r.text[0],
        min_new_tokens=10,
        max_new_tokens=10,
        do_text_normalization=False,
        do_homophone_replacement=False,
        split_text=False,
    )
    assert tiny_engine.speaker_from_audio(first.audio) == r.voice_sample


def test_params_per_text_batch_like_separate_calls(tiny_engine):
    s1, s2 = tiny_engine.sample_speaker(seed=1), tiny_engine.sample_speaker(seed=2)
    texts = ["今天天气很好", "我们去公园散步吧", "明天见"]
    params = [
        SamplingParams(seed=1, speaker=s1, max_new_tokens=9, refine_text=False),
        SamplingParams(seed=2, speaker=s2, max_new_tokens=11, refine_text=False, prompt="[speed_2]"),
        SamplingParams(seed=3, max_new_tokens=7, refine_text=False, temperature=0.6),
    ]
    batched = tiny_engine.synthesize(texts, params)
    for text, p, r in zip(texts, params, batched, strict=True):
        [alone] = tiny_engine.synthesize(text, p)
        np.testing.assert_array_equal(r.codes, alone.codes)
        np.testing.assert_array_equal(r.audio, alone.audio)


def test_params_per_text_must_match_the_texts(tiny_engine):
    with pytest.raises(ValueError, match="2 SamplingParams for 3 texts"):
        tiny_engine.synthesize(["a", "b", "c"], [SamplingParams(), SamplingParams()])
    with pytest.raises(ValueError, match="params must be SamplingParams"):
        tiny_engine.synthesize(["a", "b"], [SamplingParams(), {"seed": 1}])


# ---------------------------------------------------------------- determinism and batching


def test_same_seed_same_output(tiny_engine):
    a = synth(tiny_engine, "你好，世界。", seed=11)[0]
    b = synth(tiny_engine, "你好，世界。", seed=11)[0]
    np.testing.assert_array_equal(a.codes, b.codes)
    np.testing.assert_array_equal(a.audio, b.audio)


def test_different_seeds_differ(tiny_engine):
    a = synth(tiny_engine, "你好，世界。", seed=11)[0]
    b = synth(tiny_engine, "你好，世界。", seed=12)[0]
    assert a.codes.shape != b.codes.shape or not np.array_equal(a.codes, b.codes)


def test_unseeded_runs_follow_global_seed(tiny_engine):
    torch.manual_seed(0)
    a = synth(tiny_engine, "你好。", seed=None)[0]
    torch.manual_seed(0)
    b = synth(tiny_engine, "你好。", seed=None)[0]
    np.testing.assert_array_equal(a.codes, b.codes)


@pytest.mark.parametrize("refine", [False, True])
def test_batch_equals_each_text_alone(tiny_engine, refine):
    texts = ["你好。", "今天天气很好，我们去公园散步吧。", "一二三。"]
    batch = synth(tiny_engine, texts, seed=5, refine_text=refine)
    assert len(batch) == len(texts)
    for text, got in zip(texts, batch, strict=True):
        [alone] = synth(tiny_engine, text, seed=5, refine_text=refine)
        assert got.text == alone.text
        np.testing.assert_array_equal(got.codes, alone.codes)
        assert got.audio.shape == alone.audio.shape
        np.testing.assert_allclose(got.audio, alone.audio, atol=1e-5)


def test_batches_larger_than_max_num_seqs(tiny_engine):
    texts = [f"第{i}句话。" for i in range(tiny_engine.max_num_seqs + 2)]
    results = synth(tiny_engine, texts, max_new_tokens=4, min_new_tokens=4)
    assert len(results) == len(texts)
    assert all(r.codes.shape == (4, 4) for r in results)
    [last] = synth(tiny_engine, texts[-1], max_new_tokens=4, min_new_tokens=4)
    np.testing.assert_array_equal(results[-1].codes, last.codes)


# ---------------------------------------------------------------- refine pass


@pytest.mark.parametrize("refine", [False, True])
def test_refine_on_and_off(tiny_engine, refine):
    [r] = synth(tiny_engine, "你好，世界。", refine_text=refine, max_new_tokens=8)
    assert len(r.audio) == 512 * r.codes.shape[0] - 256
    assert len(r.text) == 1 and isinstance(r.text[0], str)
    if not refine:
        assert r.text == ["你好，世界。"]


def test_refine_text_drops_control_ids_and_is_seeded(tiny_engine):
    p = params(refine_text=True, refine=RefineParams(max_new_tokens=10, seed=4))
    [ra] = tiny_engine.synthesize("你好。", p)
    [rb] = tiny_engine.synthesize("你好。", p)
    a, b = ra.text, rb.text
    assert a == b and isinstance(a[0], str)
    # ids from [break_0] on (prosody/speed/oral tokens) are dropped before decoding
    assert all(i < tiny_engine.tokenizer.break_0_id for i in tiny_engine.tokenizer.encode(a[0]))


# ---------------------------------------------------------------- speakers


def test_sample_speaker_is_deterministic(tiny_engine):
    a, b, c = (tiny_engine.sample_speaker(s) for s in (7, 7, 8))
    assert a == b and a != c
    emb = decode_speaker(a, expected_dim=tiny_engine.hidden_size)
    assert emb.shape == (64,)


def test_synthesize_with_speaker(tiny_engine):
    spk = tiny_engine.sample_speaker(3)
    [with_spk] = synth(tiny_engine, "你好。", speaker=spk)
    [without] = synth(tiny_engine, "你好。")
    assert len(with_spk.audio) == 512 * with_spk.codes.shape[0] - 256
    # the speaker embedding replaces the [spk_emb] row, so the model sees a different prompt
    assert with_spk.codes.shape != without.codes.shape or not np.array_equal(with_spk.codes, without.codes)


def test_speaker_from_audio(tiny_engine):
    wav = np.random.default_rng(0).standard_normal(SAMPLE_RATE).astype(np.float32) * 0.1
    s = tiny_engine.speaker_from_audio(wav)
    assert isinstance(s, str)
    codes = decode_prompt_codes(s)
    assert codes.shape == (4, (1 + SAMPLE_RATE // 256) // 2)
    assert ((codes >= 0) & (codes < 625)).all()
    # usable as a zero-shot voice prompt
    [r] = synth(tiny_engine, "你好。", speaker_sample=s, speaker_sample_text="样本。", max_new_tokens=6)
    assert len(r.audio) == 512 * r.codes.shape[0] - 256


def test_speaker_from_audio_rejects_bad_wav(tiny_engine):
    with pytest.raises(ValueError, match="1-D"):
        tiny_engine.speaker_from_audio(np.zeros(100, np.float32))
    with pytest.raises(ValueError, match="1-D"):
        tiny_engine.speaker_from_audio(np.zeros((2, 4096), np.float32))


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "texts,match",
    [
        ("", "text 0 is empty"),
        ("   \n\t", "text 0 is empty"),
        ([], "non-empty"),
        (["你好。", 3], "text 1 must be a string"),
        ([None], "text 0 must be a string"),
    ],
)
def test_bad_texts(tiny_engine, texts, match):
    with pytest.raises(ValueError, match=match):
        tiny_engine.synthesize(texts, params())


def test_bad_params_object(tiny_engine):
    with pytest.raises(ValueError, match="SamplingParams"):
        tiny_engine.synthesize("你好。", {"seed": 1})


@pytest.mark.parametrize(
    "speaker,match",
    [
        ("not a speaker", "invalid speaker embedding"),
        ("", "speaker embedding string is empty"),
        (encode_speaker(torch.randn(768)), "dimension 768, expected 64"),
    ],
)
def test_bad_speaker(tiny_engine, speaker, match):
    with pytest.raises(ValueError, match=match):
        tiny_engine.synthesize("你好。", params(speaker=speaker))


def test_bad_speaker_sample(tiny_engine):
    with pytest.raises(ValueError, match="prompt codes"):
        tiny_engine.synthesize("你好。", params(speaker_sample="garbage"))
    too_big = encode_prompt_codes(np.full((4, 3), 700, dtype=np.int64))
    with pytest.raises(ValueError, match="speaker_sample"):
        tiny_engine.synthesize("你好。", params(speaker_sample=too_big))
    wrong_rows = encode_prompt_codes(np.zeros((3, 3), dtype=np.int64))
    with pytest.raises(ValueError, match="speaker_sample"):
        tiny_engine.synthesize("你好。", params(speaker_sample=wrong_rows))
    empty = encode_prompt_codes(np.zeros((4, 0), dtype=np.int64))
    with pytest.raises(ValueError, match="speaker_sample"):
        tiny_engine.synthesize("你好。", params(speaker_sample=empty))


def test_unknown_tags_in_the_text_are_spoken_as_text(tiny_engine):
    """As in the reference: a markdown link or a bracketed word in the text is text (LLM output is full of
    them); only the prompts must hold known control tokens (tests/fidelity has such a text too)."""
    spoken = "".join(tiny_engine.core.stage.inputs.prepare("你好[foo]。看 [Dapr](https://dapr.io/)", params()).segments)
    assert "[foo]" in spoken and "[Dapr]" in spoken
    [result] = tiny_engine.synthesize("你好[foo]。", params(max_new_tokens=8))
    assert result.codes.shape[0] > 0


def test_bad_prompt_tags(tiny_engine):
    with pytest.raises(ValueError, match=r"prompt has unknown control token"):
        tiny_engine.synthesize("你好。", params(prompt="[speed_5][nope]"))
    with pytest.raises(ValueError, match=r"refine.prompt has unknown control token"):
        tiny_engine.synthesize("你好。", params(refine=RefineParams(prompt="[nope]")))


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"temperature": 0}, "temperature"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": [0.3, 0.3]}, "temperature"),
        ({"temperature": (0.3, 0.3, 0.3, 0.0)}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_new_tokens": 10, "max_new_tokens": 5}, "min_new_tokens"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"min_new_tokens": -1}, "min_new_tokens"),
        ({"seed": -1}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"lang": "fr"}, "lang"),
        ({"speaker": 5}, "speaker"),
        ({"refine": {"temperature": 0.7}}, "refine"),
    ],
)
def test_sampling_params_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


@pytest.mark.parametrize(
    "kw",
    [{"temperature": 0}, {"top_p": 0}, {"top_k": -1}, {"min_new_tokens": 9, "max_new_tokens": 8}, {"seed": -3}],
)
def test_refine_params_validation(kw):
    with pytest.raises(ValueError, match="refine"):
        RefineParams(**kw)


def test_sampling_params_accepts_per_codebook_temperature(tiny_engine):
    p = params(temperature=[0.1, 0.2, 0.3, 0.4])
    assert p.temperature == (0.1, 0.2, 0.3, 0.4) and p.temperatures == p.temperature
    [r] = tiny_engine.synthesize("你好。", p)
    assert r.codes.shape[1] == 4
