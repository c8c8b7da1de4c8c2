"""engine/input_processor.py: validation, sentences, and the per-request audio budget."""

from __future__ import annotations

import pytest

from chattts_serve import SamplingParams
from chattts_serve.engine.input_processor import InputProcessor
from chattts_serve.models.chattts.config import TOKENS_PER_SECOND
from chattts_serve.sampling_params import speed_prompt

TEXT = "今天天气很好。我们去公园散步吧。明天见。"  # three sentences


@pytest.fixture(scope="module")
def inputs(tiny_engine) -> InputProcessor:
    gpt = tiny_engine.model.config.gpt
    return InputProcessor(tiny_engine.tokenizer, gpt.hidden_size, gpt.num_vq, max_audio_seconds=10.0)


def p(**kw) -> SamplingParams:
    return SamplingParams(**{"seed": 1, "refine_text": False, **kw})


def test_a_request_within_budget_keeps_its_max_new_tokens(inputs):
    prep = inputs.prepare(TEXT, p(max_new_tokens=100, first_sentence_voice=False))
    assert len(prep.segments) == 3 and prep.max_new_tokens == 100


def test_max_new_tokens_is_capped_at_each_pass_share_of_the_budget(inputs):
    budget = int(10.0 * TOKENS_PER_SECOND)  # 468 tokens
    prep = inputs.prepare(TEXT, p(max_new_tokens=2048))  # 3 sentences + the voice step = 4 passes
    assert prep.voice_step and prep.max_new_tokens == budget // 4
    plain = inputs.prepare(TEXT, p(max_new_tokens=2048, first_sentence_voice=False))
    assert plain.max_new_tokens == budget // 3


def test_a_request_whose_minimum_passes_the_budget_is_refused(inputs):
    with pytest.raises(
        ValueError, match=r"at least 13 s of audio \(3 audio passes x min_new_tokens 200\); the limit is 10 s"
    ):
        inputs.prepare(TEXT, p(min_new_tokens=200, max_new_tokens=200, first_sentence_voice=False))
    many = "\n".join(f"第{i}行。" for i in range(100))
    with pytest.raises(ValueError, match="the limit is 10 s"):
        inputs.prepare(many, p(min_new_tokens=20, max_new_tokens=20))


def test_the_engine_stops_a_request_at_its_budget(tiny_ckpt):
    from chattts_serve import Engine, EngineConfig

    engine = Engine.from_pretrained(tiny_ckpt, config=EngineConfig.with_slots(2, max_audio_seconds=1.0))
    [r] = engine.synthesize("今天天气很好。明天见。", p(max_new_tokens=2048, first_sentence_voice=False))
    assert all(len(s.codes) <= int(TOKENS_PER_SECOND) // 2 for s in r.segments)
    assert r.duration <= 1.0


def test_markdown_cleanup_is_opt_in(inputs):
    text = "请看 **[Dapr](https://dapr.io/)** 的文档 🚀。"
    assert "https" in "".join(inputs.prepare(text, p()).segments)  # as the reference: the target is spoken
    cleaned = "".join(inputs.prepare(text, p(text_cleanup="markdown")).segments)
    assert "Dapr" in cleaned and "https" not in cleaned and "*" not in cleaned and "🚀" not in cleaned
    with pytest.raises(ValueError, match="nothing to speak"):
        inputs.prepare("🚀 ✅", p(text_cleanup="markdown"))
    with pytest.raises(ValueError, match="text_cleanup must be one of"):
        p(text_cleanup="html")


# ------------------------------------------------------------------------------- SSML and the lexicon


def code_prompt_ids(inputs: InputProcessor, text: str, params: SamplingParams) -> list[list[int]]:
    """The infer_code prompt ids of each sentence, as the pipeline builds them (no speaker, no sample)."""
    from chattts_serve.models.chattts.tokenizer import code_prompt

    prep = inputs.prepare(text, params)
    return [inputs.tokenizer.encode(code_prompt(s, prep.params.prompt, has_speaker=False)) for s in prep.segments]


def test_ssml_gives_the_prompt_ids_of_its_plain_text(inputs):
    tok = inputs.tokenizer
    ssml = '<speak><prosody rate="slow">今天<break time="500ms"/>天气<break strength="weak"/>很好。</prosody></speak>'
    ids = code_prompt_ids(inputs, ssml, p())
    assert ids == code_prompt_ids(inputs, "今天[lbreak]天气[uv_break]很好。", p(prompt="[speed_4]"))
    [one] = ids
    assert one[:2] == [tok.token_id("[Stts]"), tok.token_id("[empty_spk]")]
    assert tok.token_id("[speed_4]") in one and tok.token_id("[speed_5]") not in one
    assert tok.token_id("[lbreak]") in one and tok.token_id("[uv_break]") in one
    # The rate replaces the prompt's [speed_N] and keeps the rest of the prompt.
    prep = inputs.prepare(ssml, p(prompt="[oral_2][speed_7]"))
    assert prep.params.prompt == "[oral_2][speed_4]"


def test_the_lexicon_changes_the_prompt_ids_before_normalisation(inputs):
    from chattts_serve.text.lexicon import homophone

    plain = code_prompt_ids(inputs, "银行很长。", p())
    fixed = code_prompt_ids(inputs, "银行很长。", p(lexicon={"银行": "yin2 hang2", "长": "zhang3"}))
    expected = code_prompt_ids(inputs, f"{homophone('yin2')}{homophone('hang2')}很{homophone('zhang3')}。", p())
    assert fixed == expected != plain
    # In SSML it applies to the document's text, not to what <phoneme> asks for.
    ssml = '<speak>银行<phoneme alphabet="pinyin" ph="chang2">长</phoneme>。</speak>'
    got = code_prompt_ids(inputs, ssml, p(lexicon={"银行": "yin2 hang2", "长": "zhang3"}))
    assert got == code_prompt_ids(inputs, f"{homophone('yin2')}{homophone('hang2')}{homophone('chang2')}。", p())
    with pytest.raises(ValueError, match="no common character reads only le4"):
        inputs.prepare("快乐。", p(lexicon={"乐": "le4"}))


def test_bad_ssml_is_refused_before_the_engine(inputs):
    with pytest.raises(ValueError, match=r"unknown SSML tag <audio> at line 1, column 8"):
        inputs.prepare('<speak><audio src="x.wav"/></speak>', p())
    # Plain text that merely mentions a tag is text, as before.
    assert inputs.prepare("请说 <speak> 这个词。", p()).segments


def test_ssml_synthesizes_as_its_plain_text(tiny_engine):
    ssml = '<speak>今天<break time="1s"/>天气很好。<sub alias="明天见">明儿见</sub>。</speak>'
    params = p(max_new_tokens=20, first_sentence_voice=False)
    [a] = tiny_engine.synthesize(ssml, params)
    [b] = tiny_engine.synthesize("今天[lbreak]天气很好。明天见。", params)
    assert a.text == b.text and len(a.text) == 2 and (a.codes == b.codes).all()


# ------------------------------------------------------------------------ the text bound after expansion


def test_the_text_bound_holds_after_every_expansion(inputs):
    from chattts_serve.text.bound import TextTooLong

    bomb = p(lexicon={"a": "啊" * 256}, max_text_chars=4096)
    with pytest.raises(TextTooLong, match="after the lexicon's replacements; the limit is 4096"):
        inputs.prepare("a" * 4000, bomb)  # 4 KB of text, a megabyte once replaced
    with pytest.raises(TextTooLong, match="the limit is 20000"):  # the default bound (the offline API's)
        inputs.prepare(("a" * 8 + "。") * 250, p(lexicon={"a": "啊" * 255}))
    spelled = '<speak><say-as interpret-as="characters">' + "ab" * 60 + "</say-as></speak>"  # "A B A B ..."
    with pytest.raises(TextTooLong, match="after SSML's <say-as>"):
        inputs.prepare(spelled, p(max_text_chars=len(spelled)))
    with pytest.raises(TextTooLong, match="after the lexicon's replacements"):
        inputs.prepare("<speak>" + "a" * 100 + "</speak>", bomb)
    emails = "写信给 x@y.cn 。" * 20  # each address "x at y.cn": longer than it was
    with pytest.raises(TextTooLong, match="after markdown cleanup"):
        inputs.prepare(emails, p(text_cleanup="markdown", max_text_chars=len(emails)))
    with pytest.raises(ValueError, match=f"text has {len(emails)} characters; the limit is 100"):
        inputs.prepare(emails, p(max_text_chars=100))
    # Within the bound, as before.
    assert inputs.prepare("a" * 16, bomb).segments
    with pytest.raises(ValueError, match="max_text_chars must be an int >= 1"):
        p(max_text_chars=0)


# ---------------------------------------------------------------------------- SSML at several rates

MIXED = '<speak>你好<break time="500ms"/>世界。<prosody rate="slow">慢一点。</prosody></speak>'


def test_each_rate_run_has_its_own_speed_prompt(inputs):
    tok = inputs.tokenizer
    prep = inputs.prepare(MIXED, p(prompt="[oral_2][speed_7]"))
    assert prep.segments == ["你好[lbreak]世界。", "慢一点。"]
    assert prep.prompts == ["[oral_2][speed_7]", "[oral_2][speed_4]"] and prep.params.prompt == "[oral_2][speed_7]"
    first, slow = (
        code_prompt_ids(inputs, "你好[lbreak]世界。", p(prompt="[oral_2][speed_7]")),
        code_prompt_ids(inputs, "慢一点。", p(prompt="[oral_2][speed_4]")),
    )
    assert tok.token_id("[speed_4]") in slow[0] and tok.token_id("[speed_4]") not in first[0]
    # A rate inside a sentence cuts it; with split_text off, each run is one segment.
    prep = inputs.prepare('<speak>今天<prosody rate="fast">天气</prosody>很好。明天见。</speak>', p(split_text=False))
    assert prep.segments == ["今天", "天气", "很好。明天见。"]
    assert prep.prompts == ["[speed_5]", "[speed_6]", "[speed_5]"]
    # One rate: the request's prompt, no per-segment prompts.
    assert inputs.prepare('<speak><prosody rate="slow">慢。一点。</prosody></speak>', p()).prompts is None


def test_the_slow_runs_sequence_is_prompted_with_its_speed(tiny_engine):
    """The code sequences the pipeline makes: each with its segment's [speed_N]."""
    from chattts_serve.audio.policy import StreamPolicy

    core, tok = tiny_engine.core, tiny_engine.tokenizer
    prep = core.prepare(MIXED, p(first_sentence_voice=False))
    seqs = core.stage.pipeline.start("mixed-rates", prep, StreamPolicy.one_shot(), 0, 0.0)
    try:
        ids = [s.payload.ids for s in seqs]
    finally:
        core.stage.pipeline.drop("mixed-rates")
    assert [tok.token_id("[speed_5]") in i for i in ids] == [True, False]
    assert [tok.token_id("[speed_4]") in i for i in ids] == [False, True]


def test_a_document_at_several_rates_is_its_runs_spoken_as_requests(tiny_engine):
    params = p(max_new_tokens=16, first_sentence_voice=False)
    [mixed] = tiny_engine.synthesize(MIXED, params)
    slow_params = p(max_new_tokens=16, first_sentence_voice=False, prompt="[speed_4]")
    first, slow = tiny_engine.synthesize(["你好[lbreak]世界。", "慢一点。"], [params, slow_params])
    assert [s.text for s in mixed.segments] == [first.text[0], slow.text[0]]
    assert (mixed.segments[0].codes == first.segments[0].codes).all()
    assert (mixed.segments[1].codes == slow.segments[0].codes).all()


def test_stretch_mode_gives_each_rate_run_a_stretch_factor_not_a_prompt(inputs):
    """speed_mode "stretch": a rate run keeps the request's prompt and gets its rate as its factor (a run
    without one: the response's); "both": the prompt and the factor; "prompt": as before, no factors."""
    stretched = inputs.prepare(MIXED, p(speed_mode="stretch", first_sentence_voice=False))
    assert stretched.prompts is None and stretched.stretches == (1.0, 0.75)
    both = inputs.prepare(MIXED, p(speed_mode="both", stretch=2.0, first_sentence_voice=False))
    assert both.prompts == ["[speed_5]", speed_prompt(0.75)] and both.stretches == (2.0, 0.75)
    assert inputs.prepare(MIXED, p(first_sentence_voice=False)).stretches is None
    assert inputs.prepare(TEXT, p(speed_mode="stretch", stretch=0.5)).stretches is None  # the response's alone
    whole = inputs.prepare('<speak><prosody rate="10">快。</prosody></speak>', p(speed_mode="stretch"))
    assert whole.stretches == (4.0,) and whole.params.prompt == "[speed_5]"  # clamped to what a stretch takes


def test_a_slowed_rate_run_counts_at_its_stretched_length(inputs):
    """Each run counted at the slowest factor: x-slow (0.5) halves the model audio the budget allows."""
    doc = '<speak>快一点。<prosody rate="x-slow">慢一点。</prosody></speak>'
    budget = int(10.0 * TOKENS_PER_SECOND)
    prompted = inputs.prepare(doc, p(max_new_tokens=2048, first_sentence_voice=False))
    stretched = inputs.prepare(doc, p(max_new_tokens=2048, first_sentence_voice=False, speed_mode="stretch"))
    assert prompted.max_new_tokens == budget // 2
    assert stretched.max_new_tokens == int(budget * 0.5) // 2
