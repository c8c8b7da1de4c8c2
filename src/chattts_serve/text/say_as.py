"""SSML ``<say-as interpret-as=...>`` as words ChatTTS reads (``text/ssml.py``).

The normaliser deletes digits and most symbols (as the reference does: it has no number reading), so
digits, telephone numbers and dates are written out here, in Chinese or English (the text's language).
"""

from __future__ import annotations

import re

INTERPRET_AS = ("characters", "spell-out", "digits", "telephone", "date")
DATE_FORMATS = ("ymd", "dmy", "mdy", "ym", "my", "md", "dm", "y", "m", "d")

_ZH_DIGITS = "零一二三四五六七八九"
_EN_DIGITS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
_EN_TEENS = ("ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen")
_EN_TENS = ("", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety")
_EN_ORDINAL = {"one": "first", "two": "second", "three": "third", "five": "fifth", "eight": "eighth"}
_EN_MONTHS = (
    *("January", "February", "March", "April", "May", "June", "July"),
    *("August", "September", "October", "November", "December"),
)
_GROUP = re.compile(r"\d+")


def say_as(kind: str, text: str, lang: str, fmt: str | None = None) -> str:
    """``text`` read as ``kind`` (one of ``INTERPRET_AS``) in ``lang`` ("zh" or "en"); ValueError when
    ``text`` is not one (a date that is not a date)."""
    if kind in ("characters", "spell-out"):
        return " ".join(_digit(c, lang) if c.isdigit() else c.upper() for c in text if not c.isspace())
    if kind == "digits":
        sep = "" if lang == "zh" else " "
        return sep.join(_digit(c, lang) if c.isdigit() else c for c in text if not c.isspace())
    if kind == "telephone":
        return _telephone(text, lang)
    return _date(text, lang, fmt)


def _digit(c: str, lang: str, telephone: bool = False) -> str:
    d = int(c)
    if lang == "zh":
        return "幺" if telephone and d == 1 else _ZH_DIGITS[d]
    return _EN_DIGITS[d]


def _telephone(text: str, lang: str) -> str:
    groups = _GROUP.findall(text)
    if not groups:
        raise ValueError(f"telephone {text!r} has no digits")
    sep, pause = ("", "，") if lang == "zh" else (" ", ", ")
    spoken = [sep.join(_digit(c, lang, telephone=True) for c in g) for g in groups]
    plus = ("加" if lang == "zh" else "plus ") if text.strip().startswith("+") else ""
    return plus + pause.join(spoken)


def _date(text: str, lang: str, fmt: str | None) -> str:
    fields = [int(g) for g in _GROUP.findall(text)]
    if fmt is None:
        if len(fields) != 3 or len(_GROUP.findall(text)[0]) != 4:
            raise ValueError(f'date {text!r} is not YYYY-MM-DD; say which order with format (e.g. format="dmy")')
        fmt = "ymd"
    if fmt not in DATE_FORMATS:
        raise ValueError(f"date format must be one of {', '.join(DATE_FORMATS)}, got {fmt!r}")
    if len(fields) != len(fmt):
        raise ValueError(f"date {text!r} does not have the {len(fmt)} number(s) format {fmt!r} asks for")
    parts = dict(zip(fmt, fields, strict=True))
    y, m, d = parts.get("y"), parts.get("m"), parts.get("d")
    if m is not None and not 1 <= m <= 12 or d is not None and not 1 <= d <= 31:
        raise ValueError(f"date {text!r} has no month {m} or day {d}")
    if lang == "zh":
        out = "".join(_ZH_DIGITS[int(c)] for c in str(y)) + "年" if y is not None else ""
        out += _zh_number(m) + "月" if m is not None else ""
        return out + (_zh_number(d) + "日" if d is not None else "")
    words = [_EN_MONTHS[m - 1]] if m is not None else []
    if d is not None:
        words.append(_en_ordinal(d))
    if y is not None:
        words = [" ".join(words) + ","] if words else []
        words.append(_en_year(y))
    return " ".join(words)


def _zh_number(n: int) -> str:
    """0..99 in Chinese (十五, 二十一, 三十)."""
    tens, ones = divmod(n, 10)
    if tens == 0:
        return _ZH_DIGITS[ones]
    head = "" if tens == 1 else _ZH_DIGITS[tens]
    return head + "十" + (_ZH_DIGITS[ones] if ones else "")


def _en_number(n: int) -> str:
    """0..99 in English."""
    if n < 10:
        return _EN_DIGITS[n]
    if n < 19:
        return _EN_TEENS[n - 10]
    if n == 19:
        return "nineteen"
    tens, ones = divmod(n, 10)
    return _EN_TENS[tens] + (f"-{_EN_DIGITS[ones]}" if ones else "")


def _en_ordinal(n: int) -> str:
    words = _en_number(n)
    head, _, last = words.rpartition("-")
    if last in _EN_ORDINAL:
        last = _EN_ORDINAL[last]
    elif last.endswith("y"):
        last = last[:-1] + "ieth"
    else:
        last += "th"
    return f"{head}-{last}" if head else last


def _en_year(y: int) -> str:
    """1999 -> nineteen ninety-nine, 2000 -> two thousand, 2005 -> two thousand five, 2024 -> twenty
    twenty-four, 1900 -> nineteen hundred."""
    hi, lo = divmod(y, 100)
    if y < 100:
        return _en_number(y)
    if hi % 10 == 0 and lo < 10:
        return f"{_en_number(hi // 10)} thousand" + (f" {_en_number(lo)}" if lo else "")
    if lo == 0:
        return f"{_en_number(hi)} hundred"
    return f"{_en_number(hi)} {'oh ' + _en_number(lo) if lo < 10 else _en_number(lo)}"
