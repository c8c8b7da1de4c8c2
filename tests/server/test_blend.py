"""server/blend.py: the blend parser ("a(2)+b(1)") and its 400s, each naming the term."""

from __future__ import annotations

import pytest

from chattts_serve.server.blend import MAX_BLEND_TERMS, BlendError, BlendTerm, is_blend, parse_blend

SPEAKER = "\u4e00" * 20 + "\u3d01"  # base16384 text: never a '+', '(' or ')'


def test_terms_and_weights():
    assert parse_blend("alloy(2)+nova(1)") == [BlendTerm("alloy", 2.0), BlendTerm("nova", 1.0)]
    assert parse_blend("alloy+nova") == [BlendTerm("alloy"), BlendTerm("nova")]  # weight 1 by default
    assert parse_blend(" my-voice.v2 ( 0.5 ) + .25x(.25)") == [BlendTerm("my-voice.v2", 0.5), BlendTerm(".25x", 0.25)]
    assert parse_blend(f"{SPEAKER}(3)+alloy") == [BlendTerm(SPEAKER, 3.0), BlendTerm("alloy")]
    assert parse_blend("alloy(2)") == [BlendTerm("alloy", 2.0)]
    assert len(parse_blend("+".join(["alloy"] * MAX_BLEND_TERMS))) == MAX_BLEND_TERMS


def test_what_is_a_blend():
    assert is_blend("a+b") and is_blend("a(2)") and is_blend("a)")
    assert not is_blend("alloy") and not is_blend(SPEAKER) and not is_blend("my-voice.v2")


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("alloy+", "term 2 is empty"),
        ("+alloy", "term 1 is empty"),
        ("alloy+ +nova", "term 2 is empty"),
        ("alloy(0)+nova", "term 1 'alloy(0)': the weight must be a positive number"),
        ("alloy+nova(-1)", "term 2 'nova(-1)': the weight"),
        ("alloy(nan)+nova", "'alloy(nan)': the weight"),
        ("alloy(inf)+nova", "'alloy(inf)': the weight"),
        ("alloy(" + "9" * 400 + ")+nova", "the weight"),  # overflows to inf
        ("alloy(0.0)+nova", "'alloy(0.0)': the weight"),
        ("alloy()+nova", "'alloy()': the weight"),
        ("alloy(1e+2)", "term 1 'alloy(1e' is not a voice"),
        ("alloy(2+nova", "term 1 'alloy(2' is not a voice"),
        ("alloy(2)x+nova", "term 1 'alloy(2)x' is not a voice"),
        ("my voice+nova", "term 1 'my voice' is not a voice"),
        ("(2)+nova", "term 1 '(2)' is not a voice"),
        ("+".join(["alloy"] * (MAX_BLEND_TERMS + 1)), f"at most {MAX_BLEND_TERMS} voices"),
    ],
)
def test_bad_blends_name_the_term(text, says):
    with pytest.raises(BlendError) as exc:
        parse_blend(text)
    assert says in str(exc.value)


def test_a_long_term_is_shortened_in_the_message():
    with pytest.raises(BlendError) as exc:
        parse_blend(SPEAKER * 10 + "(0)+alloy")
    assert "..." in str(exc.value) and len(str(exc.value)) < 200


def test_the_request_fields_hold_a_blend_of_the_most_speaker_strings():
    import torch

    from chattts_serve.models.chattts.speaker import encode_speaker
    from chattts_serve.server.protocol import SpeechRequest, TTSRequest

    speaker = encode_speaker(torch.randn(768))  # the official hidden size: the longest speaker string
    blend = "+".join(f"{speaker}(1.5)" for _ in range(MAX_BLEND_TERMS))
    assert len(parse_blend(blend)) == MAX_BLEND_TERMS
    TTSRequest(text="你好", voice=blend)
    SpeechRequest(model="tts-1", input="你好", voice=blend)
