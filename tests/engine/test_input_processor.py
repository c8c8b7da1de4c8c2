"""engine/input_processor.py: validation, sentences, and the per-request audio budget."""

from __future__ import annotations

import pytest

from chattts_serve import SamplingParams
from chattts_serve.engine.input_processor import InputProcessor
from chattts_serve.model.config import TOKENS_PER_SECOND

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
