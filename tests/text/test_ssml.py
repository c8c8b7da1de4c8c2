"""text/ssml.py and text/say_as.py: the SSML subset -> ChatTTS text, and what is refused (by name and place)."""

from __future__ import annotations

import pytest

from chattts_serve.text.bound import TextTooLong
from chattts_serve.text.lexicon import Lexicon, homophone
from chattts_serve.text.ssml import MAX_SSML_CHARS, SsmlText, VoiceRun, is_ssml, parse_ssml, voice_runs


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
    rates = {
        "x-slow": 0.5,
        "slow": 0.75,
        "medium": 1.0,
        "fast": 1.5,
        "x-fast": 2.0,
        "50%": 0.5,
        "200%": 2.0,
        "1.0": 1.0,
    }
    assert out.rate == rates[rate]  # the number the prompt was made from (Kokoro's speed)


def test_relative_rates_and_one_rate_in_nested_prosody():
    out = parse_ssml('<speak><prosody rate="200%"><prosody rate="-50%">一样快</prosody></prosody></speak>')
    assert out.speed == "[speed_5]"


def test_text_at_several_rates_is_cut_into_its_rate_runs():
    out = parse_ssml('<speak>你好<break time="500ms"/>世界。<prosody rate="slow">慢一点。</prosody></speak>')
    runs = (("你好[lbreak]世界。", None), ("慢一点。", "[speed_4]"))
    assert out == SsmlText("你好[lbreak]世界。慢一点。", None, runs)
    # Breaks and blanks belong to the run they follow (those before any text, to the first); joined, the runs
    # are the text.
    out = parse_ssml(
        '<speak><break/><prosody rate="fast">a<break/></prosody> <prosody rate="slow">b</prosody>c</speak>'
    )
    assert out.runs == (("[uv_break]a[uv_break] ", "[speed_6]"), ("b", "[speed_4]"), ("c", None))
    assert out.run_rates == (1.5, 0.75, None)  # the numbers the prompts were made from (Kokoro's speeds)
    assert out.text == "".join(t for t, _ in out.runs) and out.speed is None
    # A rate inside a sentence cuts it; the same rate again is a run of its own (runs are in order).
    out = parse_ssml('<speak>快<prosody rate="fast">慢</prosody>快</speak>')
    assert out.runs == (("快", None), ("慢", "[speed_6]"), ("快", None))
    # One rate, wherever it is set, is still the request's speed and no runs.
    assert parse_ssml('<speak><prosody rate="fast">a</prosody><break/><prosody rate="150%">b</prosody></speak>') == (
        SsmlText("a[uv_break]b", "[speed_6]")
    )


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
        ('<speak>a\n<voice name="alloy">b</voice></speak>', r"<voice> at line 2, column 1: a change of voice is a"),
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


BOMB = (
    '<?xml version="1.0"?><!DOCTYPE l [<!ENTITY a "aaaaaaaaaa">'
    + "".join(f'<!ENTITY {chr(98 + i)} "{("&" + chr(97 + i) + ";") * 10}">' for i in range(8))
    + "]><speak>&i;</speak>"
)
"""A billion laughs (10^9 a's) behind an XML declaration."""


def test_entity_expansion_bombs_are_refused_before_expansion():
    assert is_ssml(BOMB)  # SSML with a prologue: refused as SSML, not spoken as text
    with pytest.raises(ValueError, match="DOCTYPE"):
        parse_ssml(BOMB)


W3C = (
    '<?xml version="1.0" encoding="UTF-8"?>\n'
    '<speak version="1.0" xmlns="http://www.w3.org/2001/10/synthesis"\n'
    '       xmlns:xsi="http://www.w3.org/2001/XMLSchema-instance"\n'
    '       xsi:schemaLocation="http://www.w3.org/2001/10/synthesis http://www.w3.org/TR/speech-synthesis/synthesis.xsd"\n'
    '       xml:lang="zh-CN">你好<break time="500ms"/>再见</speak>\n'
)


@pytest.mark.parametrize(
    "doc",
    [
        '<?xml version="1.0"?><speak>你好<break time="500ms"/>再见</speak>',
        '\ufeff<speak>你好<break time="500ms"/>再见</speak>',
        '\ufeff<?xml version="1.0" encoding="utf-8"?>\r\n<speak>你好<break time="500ms"/>再见</speak>',
        '\n  <?xml version="1.0"?>\n<speak>你好<break time="500ms"/>再见</speak>',
        '<!-- made by a generator --><speak>你好<break time="500ms"/>再见</speak>',
        '<?xml version="1.0"?><!-- a -->\n<?xml-stylesheet href="x"?><!--b-->'
        '<speak>你好<break time="500ms"/>再见</speak>',
        '<speak version="1.0" xmlns="http://www.w3.org/2001/10/synthesis" xml:lang="zh-CN">你好<break time="500ms"/>'
        "再见</speak>",
        W3C,
    ],
)
def test_ssml_as_generators_write_it(doc):
    assert is_ssml(doc)
    assert parse_ssml(doc).text == "你好[lbreak]再见"


def test_a_prologue_alone_does_not_make_ssml_and_positions_stay_the_texts():
    for text in ('<?xml version="1.0"?><html>x</html>', "<!-- <speak>x</speak>", "<!-- note --> say <speak>", "<?x"):
        assert not is_ssml(text)
    with pytest.raises(ValueError, match=r"unknown SSML tag <emphasis> at line 3, column 8"):
        parse_ssml('\ufeff<?xml version="1.0"\n encoding="UTF-8"?>\n<speak><emphasis>a</emphasis></speak>')
    with pytest.raises(ValueError, match="unsupported attribute 'schemaLocation'"):  # only on <speak>
        xsi = 'xmlns:xsi="http://www.w3.org/2001/XMLSchema-instance" xsi:schemaLocation="x"'
        parse_ssml(f"<speak><p {xsi}>a</p></speak>")


class _Counting(Lexicon):
    """A lexicon that counts its look-ups: the work an expansion did."""

    def lookup(self, word: str) -> str | None:
        self.lookups = getattr(self, "lookups", 0) + 1
        return super().lookup(word)


def test_what_a_document_says_is_bounded_as_it_is_written():
    lex = _Counting.from_entries({"a": "啊" * 256})
    with pytest.raises(TextTooLong, match="4096 characters after the lexicon's replacements; the limit is 4096"):
        parse_ssml("<speak>" + "a" * 4000 + "</speak>", lexicon=lex, limit=4096)
    assert lex.lookups <= 4096 // 256 + 1  # it stopped at the bound, not after 4000 words and a megabyte
    digits = '<speak xml:lang="en"><say-as interpret-as="digits">' + "7" * 1000 + "</say-as></speak>"
    with pytest.raises(TextTooLong, match="after SSML's <say-as>"):
        parse_ssml(digits, limit=4096)  # "seven seven ...": 6 characters a digit
    assert len(parse_ssml(digits, limit=6000).text) == 5999
    ok = parse_ssml("<speak>" + "a" * 16 + "</speak>", lexicon=Lexicon.from_entries({"a": "啊" * 256}), limit=4096)
    assert ok.text == "啊" * 4096


def test_size_and_depth_bounds():
    with pytest.raises(ValueError, match=f"the limit is {MAX_SSML_CHARS}"):
        parse_ssml("<speak>" + "a" * MAX_SSML_CHARS + "</speak>")
    with pytest.raises(ValueError, match="nested deeper than"):
        parse_ssml("<speak>" + "<p>" * 40 + "a" + "</p>" * 40 + "</speak>")


# ------------------------------------------------------------------------------ <voice>: the runs of a dialogue


def _runs(ssml: str) -> list[tuple[str | None, str]]:
    return [(r.voice, r.ssml) for r in voice_runs(ssml)]


def test_without_voice_the_one_run_is_the_text_itself():
    text = '<speak version="1.0">\n  今天<break time="500ms"/>天气 &amp; <sub alias="x">y</sub>。</speak>'
    assert voice_runs(text) == [VoiceRun(None, None, text)]


def test_each_voice_is_a_run_in_order_and_outside_text_is_the_requests():
    runs = voice_runs(
        '<speak>你好。<voice name="nova">我是诺娃。</voice>\n<voice name="alloy">我是艾洛伊。</voice>再见。</speak>'
    )
    assert runs == [
        VoiceRun(None, None, "<speak>你好。</speak>"),
        VoiceRun("nova", "line 1, column 11", "<speak>我是诺娃。\n</speak>"),  # whitespace: the run in progress
        VoiceRun("alloy", "line 2, column 1", "<speak>我是艾洛伊。</speak>"),
        VoiceRun(None, None, "<speak>再见。</speak>"),
    ]
    # each run reads as the text it holds
    assert [parse_ssml(r.ssml).text for r in runs] == ["你好。", "我是诺娃。", "我是艾洛伊。", "再见。"]


def test_the_elements_around_a_voice_apply_to_every_run_they_hold():
    ssml = (
        '<speak xml:lang="en-US"><prosody rate="slow">Call <voice name="nova">'
        '<say-as interpret-as="digits">12</say-as> &amp; <sub alias="W">w</sub></voice> now</prosody></speak>'
    )
    runs = voice_runs(ssml)
    assert [r.voice for r in runs] == [None, "nova", None]
    assert runs[1].ssml == (
        '<speak xml:lang="en-US"><prosody rate="slow"><say-as interpret-as="digits">12</say-as> &amp; '
        '<sub alias="W">w</sub></prosody></speak>'
    )
    assert [parse_ssml(r.ssml) for r in runs] == [
        SsmlText("Call", "[speed_4]"),
        SsmlText("one two & W", "[speed_4]"),
        SsmlText("now", "[speed_4]"),
    ]


def test_each_run_may_have_its_own_rate():
    runs = voice_runs(
        '<speak><voice name="a"><prosody rate="fast">快</prosody></voice>'
        '<voice name="b"><prosody rate="slow">慢</prosody></voice></speak>'
    )
    assert [parse_ssml(r.ssml).speed for r in runs] == ["[speed_6]", "[speed_4]"]
    # ... and its own rate runs.
    [run] = voice_runs('<speak><voice name="a"><prosody rate="fast">快</prosody>慢</voice></speak>')
    assert parse_ssml(run.ssml).runs == (("快", "[speed_6]"), ("慢", None))


def test_nested_voices_the_innermost_speaks_and_the_outer_resumes():
    runs = voice_runs('<speak><voice name="a">一<voice name="b">二</voice>三</voice></speak>')
    assert [(r.voice, parse_ssml(r.ssml).text) for r in runs] == [("a", "一"), ("b", "二"), ("a", "三")]
    assert [r.where for r in runs] == ["line 1, column 8", "line 1, column 25", "line 1, column 8"]


def test_a_voice_again_is_one_run_with_what_came_before():
    # the same name twice in a row (whitespace between) is one turn; so is the request's voice around nothing
    runs = _runs('<speak> <voice name="a">一</voice> <voice name="a">二</voice> </speak>')
    assert runs == [("a", "<speak> 一 二 </speak>")]


def test_breaks_and_punctuation_belong_to_the_run_in_progress():
    runs = _runs(
        '<speak><break/><voice name="a">一</voice>，<break time="1s"/>'
        '<voice name="b"><break strength="strong"/>二</voice>。</speak>'
    )
    # a pause between two voices ends the first one's turn; text with nothing to say is no turn of its own
    assert runs == [
        ("a", '<speak><break></break>一，<break time="1s"></break><break strength="strong"></break></speak>'),
        ("b", "<speak>二。</speak>"),
    ]
    assert parse_ssml(voice_runs('<speak><voice name="a">一</voice><break time="1s"/></speak>')[0].ssml).text == (
        "一[lbreak]"
    )


def test_nothing_to_say_is_one_run_for_the_engine_to_refuse():
    runs = voice_runs('<speak><voice name="a">。</voice><break/></speak>')
    assert runs == [VoiceRun(None, None, "<speak>。<break></break></speak>")]


def test_runs_escape_what_they_write_back():
    runs = voice_runs('<speak><voice name="a">&lt;b&gt; &amp; "q"</voice><sub alias=\'say "&amp;"\'>x</sub></speak>')
    assert [parse_ssml(r.ssml).text for r in runs] == ['<b> & "q"', 'say "&"']


@pytest.mark.parametrize(
    "ssml, match",
    [
        ("<speak>a<voice>b</voice></speak>", r"<voice> at line 1, column 9: name is required"),
        ('<speak>a<voice name=" ">b</voice></speak>', r"<voice> at line 1, column 9: name is required"),
        ('<speak><voice name="a" gender="female">b</voice></speak>', r"<voice> at .*unsupported attribute 'gender'"),
        ('<speak><sub alias="x"><voice name="a">b</voice></sub></speak>', r"<voice> at .*<sub> holds text only"),
        ('<speak><voice name="a">b</speak>', r"column 27: mismatched tag \(inside <voice> from line 1, column 8"),
        ('<speak>a\n<voice name="b"><break time="x"/>c</voice></speak>', r"<break> at line 2, column 17: time"),
        ('<speak><voice name="a"><emphasis>b</emphasis></voice></speak>', r"unknown SSML tag <emphasis> at line 1"),
        ('<!DOCTYPE x [<!ENTITY e "v">]><speak><voice name="a">&e;</voice></speak>', r"DOCTYPE"),
        ('<speak><voice name="a">&e;</voice></speak>', r"undefined entity"),
    ],
)
def test_bad_voices_are_refused_naming_the_place(ssml, match):
    with pytest.raises(ValueError, match=match):
        voice_runs(ssml)


def test_runs_keep_the_bounds():
    with pytest.raises(ValueError, match=f"the limit is {MAX_SSML_CHARS}"):
        voice_runs('<speak><voice name="a">' + "a" * MAX_SSML_CHARS + "</voice></speak>")
