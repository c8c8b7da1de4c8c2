"""Each sentence's place in a request's audio (``SegmentSpan``), counted by the pipeline: sentences are back to
back, each exactly as long as a one-shot decode of its codes (512 * steps - 256 samples)."""

from __future__ import annotations

from chattts_serve import SamplingParams
from chattts_serve.models.chattts.config import SAMPLE_RATE, SAMPLES_PER_TOKEN


def _params(**kw) -> SamplingParams:
    return SamplingParams(**{"seed": 5, "max_new_tokens": 24, "refine_text": False, **kw})


def test_spans_are_back_to_back_and_as_long_as_their_codes(tiny_engine):
    [r] = tiny_engine.synthesize("今天天气真不错。我们去公园吧。明天见。", _params())
    spans = r.spans
    assert [s.index for s in spans] == [0, 1, 2]
    assert spans[0].start == 0 and spans[-1].end == len(r.audio)
    assert spans[-1].end_s == r.duration == len(r.audio) / SAMPLE_RATE
    for before, after in zip(spans, spans[1:], strict=False):
        assert after.start == before.end
    for span, seg in zip(spans, r.segments, strict=True):
        steps = len(seg.codes)
        assert span.end - span.start == max(SAMPLES_PER_TOKEN * steps - SAMPLES_PER_TOKEN // 2, 0)
    assert [s.text for s in spans] == ["今天天气真不错。", "我们去公园吧。", "明天见。"]


def test_span_text_leaves_out_control_tokens(tiny_engine):
    [r] = tiny_engine.synthesize('<speak>你好<break time="300ms"/>世界。</speak>', _params(max_new_tokens=8))
    assert "[uv_break]" in r.segments[0].text  # what the model was given ...
    assert r.spans[0].text == "你好世界。"  # ... and what a caption shows
