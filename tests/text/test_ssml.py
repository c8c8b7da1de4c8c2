"""text/ssml.py and text/say_as.py: the SSML subset -> ChatTTS text, and what is refused (by name and place)."""

from __future__ import annotations

import pytest

from chattts_serve.text.lexicon import Lexicon, homophone
from chattts_serve.text.ssml import MAX_SSML_CHARS, SsmlText, is_ssml, parse_ssml


def test_what_counts_as_ssml():
    assert is_ssml("<speak>x</speak>") and is_ssml('\n  <speak version="1.0">x</speak>') and is_ssml("<speak/>")
    assert not is_ssml("say <speak>x</speak>") and not is_ssml("<speaker>") and not is_ssml("[uv_break]")


@pytest.mark.parametrize(
    "tag, token",
    [
        ('<break time="500ms"/>', "[lbreak]"),
        ('<break time="2s"/>', "[lbreak]"),  # longer than ChatTTS pauses: its strongest break
        ('<break time="200ms"/>', "[uv_break]"),
        ('<break time="0ms"/>', ""),
        ("<break/>", "[uv_break]"),
        ('<break strength="none"/>', ""),
        ('<break strength="x-weak"/>', "[uv_break]"),
        ('<break strength="weak"/>', "[uv_break]"),
        ('<break strength="medium"/>', "[uv_break]"),
        ('<break strength="strong"/>', "[lbreak]"),
        ('<break strength="x-strong"/>', "[lbreak]"),
    ],
)
def test_breaks_are_chattts_break_tokens(tag, token):
    assert parse_ssml(f"<speak>你好{tag}世界。</speak>") == SsmlText(f"你好{token}世界。")


@pytest.mark.parametrize(
    "rate, speed",
    [("x-slow", 2), ("slow", 4), ("medium", 5), ("fast", 6), ("x-fast", 8), ("50%", 2), ("200%", 8), ("1.0", 5)],
)
def test_prosody_rate_is_the_requests_speed(rate, speed):
    out = parse_ssml(f'<speak><prosody rate="{rate}">慢慢说。再说一次。</prosody><break/></speak>')
    assert out == SsmlText("慢慢说。再说一次。[uv_break]", f"[speed_{speed}]")


def test_relative_rates_and_one_rate_in_nested_prosody():
    out = parse_ssml('<speak><prosody rate="200%"><prosody rate="-50%">一样快</prosody></prosody></speak>')
    assert out.speed == "[speed_5]"


def test_mixed_rates_are_refused_with_where_they_were_set():
    with pytest.raises(ValueError, match=r"mixes speaking rates \(<prosody rate> at line 1, column 9, outside"):
        parse_ssml('<speak>快<prosody rate="fast">慢</prosody></speak>')
    with pytest.raises(ValueError, match="mixes speaking rates"):
        parse_ssml('<speak><prosody rate="fast">a</prosody><prosody rate="slow">b</prosody></speak>')


def test_say_as_in_chinese():
    s = parse_ssml(
        "<speak>电话<say-as interpret-as='telephone'>+86 138-0013</say-as>，"
        "<say-as interpret-as='date'>2024-03-15</say-as>，<say-as interpret-as='digits'>2024</say-as>，"
        "<say-as interpret-as='date' format='md'>3/1</say-as>，<say-as interpret-as='characters'>AI</say-as></speak>"
    )
    assert s.text == "电话加八六，幺三八，零零幺三，二零二四年三月十五日，二零二四，三月一日，A I"


def test_say_as_in_english():
    s = parse_ssml(
        '<speak xml:lang="en-US">Call <say-as interpret-as="telephone">555-1234</say-as> on '
        '<say-as interpret-as="date" format="mdy">12/21/1999</say-as> or '
        '<say-as interpret-as="date">2005-03-02</say-as>. Code <say-as interpret-as="spell-out">ab1</say-as>, '
        '<say-as interpret-as="digits">42</say-as>.</speak>'
    )
    assert s.text == (
        "Call five five five, one two three four on December twenty-first, nineteen ninety-nine or "
        "March second, two thousand five. Code A B one, four two."
    )
    assert parse_ssml("<speak>It is <say-as interpret-as='date'>2024-11-03</say-as></speak>", lang="en").text == (
        "It is November third, twenty twenty-four"
    )


def test_sub_phoneme_and_the_lexicon():
    lex = Lexicon.from_entries({"长城": "chang2 cheng2", "WWW": "不该替换"})
    s = parse_ssml(
        '<speak>他<phoneme alphabet="pinyin" ph="zhang3">长</phoneme>大了，去长城。'
        '<sub alias="万维网">WWW</sub></speak>',
        lexicon=lex,
    )
    # The lexicon applies to the document's own text; <sub> and <phoneme> say exactly what they say.
    assert s.text == f"他{homophone('zhang3')}大了，去{homophone('chang2')}{homophone('cheng2')}。万维网"


def test_whitespace_entities_and_namespaces():
    s = parse_ssml(
        '<speak version="1.0" xmlns="http://www.w3.org/2001/10/synthesis" xml:lang="zh-CN">\n'
        "  <p><s>第一句 &amp; 第二句。</s></p>\n  &#x4e00;\n</speak>"
    )
    assert s.text == "第一句 & 第二句。 一"


@pytest.mark.parametrize(
    "ssml, match",
    [
        ("<speak>a <emphasis>b</emphasis></speak>", r"unknown SSML tag <emphasis> at line 1, column 10"),
        ('<speak>a\n<voice name="alloy">b</voice></speak>', r"<voice> at line 2, column 1: changing voice"),
        (
            '<speak>a <break time="5ms"></speak>',
            r"malformed SSML at line 1, column 30: mismatched tag \(inside <break>",
        ),
        ("<speak>a", r"malformed SSML at line 1, column 9: no element found \(inside <speak>"),
        ("<speak>&foo;</speak>", r"line 1, column 8: undefined entity"),
        (
            '<!DOCTYPE speak [<!ENTITY a "b">]><speak>&a;</speak>',
            r"DOCTYPE or entity declarations \(<!DOCTYPE at line 1, column 1",
        ),
        ('<speak>\n  <break time="soon"/></speak>', r"<break> at line 2, column 3: time must be"),
        ('<speak><break strength="loud"/></speak>', r"strength must be one of"),
        (
            '<speak><prosody pitch="high">a</prosody></speak>',
            r"<prosody> at line 1, column 8: unsupported attribute 'pitch'",
        ),
        ('<speak><prosody rate="-100%">a</prosody></speak>', r"rate must be"),
        ('<speak><phoneme alphabet="ipa" ph="x">长</phoneme></speak>', r"<phoneme> at .*only alphabet=\"pinyin\""),
        ('<speak><phoneme alphabet="pinyin" ph="le4">乐</phoneme></speak>', r"no common character reads only le4"),
        ("<speak><sub>WWW</sub></speak>", r"<sub> at line 1, column 8: alias is required"),
        ('<speak><say-as interpret-as="cardinal">1</say-as></speak>', r"interpret-as must be one of"),
        ('<speak><say-as interpret-as="date">3/1/2024</say-as></speak>', r"is not YYYY-MM-DD"),
        ('<speak><say-as interpret-as="date">2024-13-01</say-as></speak>', r"no month 13"),
        ('<speak><say-as interpret-as="digits"><break/></say-as></speak>', r"<say-as> holds text only"),
        ("<speak><speak>a</speak></speak>", r"<speak> is the root and only the root"),
        ('<speak><x:y xmlns:x="urn:x">a</x:y></speak>', r"unknown SSML tag <y> at line 1, column 8 \(namespace"),
        ("<speak><break>a</break></speak>", r"<break> at line 1, column 8 must be empty"),
    ],
)
def test_bad_ssml_is_refused_naming_the_tag_and_position(ssml, match):
    with pytest.raises(ValueError, match=match):
        parse_ssml(ssml)


def test_entity_expansion_bombs_are_refused_before_expansion():
    bomb = (
        '<?xml version="1.0"?><!DOCTYPE l [<!ENTITY a "aaaaaaaaaa">'
        + "".join(f'<!ENTITY {chr(98 + i)} "{("&" + chr(97 + i) + ";") * 10}">' for i in range(8))
        + "]><speak>&i;</speak>"
    )
    with pytest.raises(ValueError, match="DOCTYPE"):
        parse_ssml(bomb)


def test_size_and_depth_bounds():
    with pytest.raises(ValueError, match=f"the limit is {MAX_SSML_CHARS}"):
        parse_ssml("<speak>" + "a" * MAX_SSML_CHARS + "</speak>")
    with pytest.raises(ValueError, match="nested deeper than"):
        parse_ssml("<speak>" + "<p>" * 40 + "a" + "</p>" * 40 + "</speak>")
