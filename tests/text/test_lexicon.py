"""text/lexicon.py: pinyin -> unambiguous homophones from pypinyin's data, the lexicon's matching, its file."""

from __future__ import annotations

import json

import pytest
from pypinyin.pinyin_dict import pinyin_dict

from chattts_serve.text.bound import TextTooLong
from chattts_serve.text.lexicon import Lexicon, homophone, is_pinyin, load_lexicon, parse_lexicon_file
from chattts_serve.text.normalize import Normalizer, load_default_homophones


def readings(ch: str) -> set[str]:
    """Every reading pypinyin's character dictionary gives ``ch``, in tone-number spelling."""
    from pypinyin.contrib.tone_convert import to_tone3

    return {to_tone3(p, neutral_tone_with_five=True) for p in pinyin_dict[ord(ch)].split(",")}


# Real polyphones and the readings a lexicon asks for.
POLYPHONES = {
    "长": ("chang2", "zhang3"),
    "行": ("xing2", "hang2"),
    "重": ("zhong4", "chong2"),
    "乐": ("yue4",),
    "着": ("zhuo2", "zhao1"),
}


@pytest.mark.parametrize("syllable", sorted({s for ss in POLYPHONES.values() for s in ss} - {"zhao1"}))
def test_a_homophone_has_only_the_asked_reading(syllable):
    ch = homophone(syllable)
    assert readings(ch) == {syllable}
    assert "\u4e00" <= ch <= "\u9fff" and ch not in load_default_homophones()  # the normaliser keeps it
    assert Normalizer()(ch) == ch


def test_each_polyphone_reading_is_in_the_polyphone():
    for ch, asked in POLYPHONES.items():
        assert set(asked) <= readings(ch), ch


@pytest.mark.parametrize("syllable", ["le4", "zhao2", "zhe5", "zhao1"])
def test_a_syllable_without_an_unambiguous_common_character_is_refused(syllable):
    # 乐 le4, 着 zhao2 / zhe: every other character read so also reads otherwise, or the normaliser
    # replaces it (泐 -> 乐), or it is too rare to be in any phrase. Refused, never guessed.
    with pytest.raises(ValueError, match=f"no common character reads only {syllable}"):
        homophone(syllable)


def test_syllable_spellings():
    assert homophone("LV4") == homophone("lü4") == homophone("lu:4")
    assert readings(homophone("lv4")) == {"lv4"}
    for bad in ("chang7", "xyz2", "chang"):
        with pytest.raises(ValueError):
            homophone(bad)
    assert is_pinyin("chang2") and is_pinyin(" zhang3  san1 ") and not is_pinyin("Dapr") and not is_pinyin("a1b")


def test_longest_match_first_and_never_inside_control_tokens():
    lex = Lexicon.from_entries({"长城": "chang2 cheng2", "长": "zhang3", "break": "BREAK", "ML": "machine learning"})
    assert (
        lex.apply("长城很长[uv_break]break ML")
        == f"{homophone('chang2')}{homophone('cheng2')}很{homophone('zhang3')}[uv_break]BREAK machine learning"
    )
    # A replacement is not matched again.
    assert Lexicon.from_entries({"a": "ab", "b": "c"}).apply("ab") == "abc"


def test_a_bounded_apply_stops_at_its_limit():
    lex = Lexicon.from_entries({"a": "啊" * 256, "长城": "chang2 cheng2"})
    text = "[uv_break]a长城a[laugh]a"
    assert lex.apply(text, limit=len(lex.apply(text))) == lex.apply(text)  # at the limit: the same text
    with pytest.raises(TextTooLong, match=r"700 characters after the lexicon's replacements; the limit is 700"):
        lex.apply(text, limit=700)

    class Counting(Lexicon):
        looked = 0

        def lookup(self, word: str) -> str | None:
            Counting.looked += 1
            return super().lookup(word)

    with pytest.raises(TextTooLong):
        Counting.from_entries({"a": "啊" * 256}).apply("a" * 4000, limit=4096)
    assert Counting.looked == 4096 // 256 + 1  # stopped at the bound: not 4000 look-ups and a megabyte


def test_request_entries_win_over_the_servers():
    server = Lexicon.from_entries({"重庆": "chong2 qing4", "行": "xing2"})
    request = Lexicon.layered(server, {"行": "hang2"})
    assert request.apply("重庆银行") == homophone("chong2") + homophone("qing4") + "银" + homophone("hang2")
    assert Lexicon.layered(server, None) is server
    assert len(request) == 2 and request == Lexicon.from_entries({"重庆": "chong2 qing4", "行": "hang2"})


@pytest.mark.parametrize(
    "raw, match",
    [
        ({"": "x"}, "a word must be"),
        ({"[x]": "y"}, "must not contain"),
        ({"a": 1}, "must map to a string"),
        ({"长": "chagn2"}, "'长': .*not a pinyin syllable"),
        ({"乐": "le4"}, "'乐': no common character reads only le4"),
        (["a"], "must be an object"),
    ],
)
def test_bad_entries_are_refused_by_name(raw, match):
    with pytest.raises(ValueError, match=match):
        Lexicon.from_entries(raw).resolved()  # shape at once; pinyin on first use (off the event loop)


def test_lexicon_files_json_and_tsv(tmp_path):
    js = tmp_path / "words.json"
    js.write_text(json.dumps({"长城": "chang2 cheng2", "Dapr": "达普"}), encoding="utf-8")
    tsv = tmp_path / "words.tsv"
    tsv.write_text("# names\n长城\tchang2 cheng2\n\nDapr\t达普\n", encoding="utf-8")
    assert parse_lexicon_file(js) == parse_lexicon_file(tsv) == {"长城": "chang2 cheng2", "Dapr": "达普"}
    assert load_lexicon(str(js)) == load_lexicon(str(tsv))
    assert load_lexicon(None) is None
    bad = tmp_path / "bad.tsv"
    bad.write_text("长城 chang2\n", encoding="utf-8")
    with pytest.raises(ValueError, match="line 1: expected word<TAB>replacement"):
        load_lexicon(str(bad))
    with pytest.raises(ValueError, match="cannot read it"):
        load_lexicon(str(tmp_path / "missing.tsv"))
