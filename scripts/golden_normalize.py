"""Regenerate tests/text/golden_normalize.json from the reference ``chattts==0.2.5``.

Run with the *reference* interpreter (it imports ``ChatTTS``, not ``chattts_serve``)::

    /path/to/refvenv/bin/python scripts/golden_normalize.py [--out tests/text/golden_normalize.json]

For every input it records the reference ``Normalizer`` output for all option combinations
(``do_text_normalization`` x ``do_homophone_replacement`` x ``lang``), once with no language
normaliser registered and once with the two toy normalisers below registered, plus the pieces
``Chat.infer(..., split_text=True)`` hands to the model (captured by stubbing ``Chat._infer``,
so no model is needed).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import itertools
import json
import logging
import os
from pathlib import Path

import ChatTTS
from ChatTTS.norm import Normalizer

INPUTS = [
    "",
    " ",
    "   \t ",
    "\n",
    "你好，世界。",
    "Hello, world.",
    "Hello world! How are you?",
    "你好!今天天气怎么样?",
    "我今天买了3个苹果，花了12.5元。",
    "The price is $3.50 (about 25 RMB).",
    "四川美食确实以辣闻名，但也有不辣的选择。[uv_break]比如甜水面、赖汤圆。",
    "[uv_break]你好[laugh]世界[lbreak]",
    "[speed_5][oral_2][laugh_0][break_6]你好",
    "[uv_break]你好[laugh",
    "a[b c[d",
    "[x]a[b",
    "a]b[x]c",
    "你好]世界[uv_break]！",
    "[你好]世界",
    "[a-b] test-case",
    "Hello 😀 world",
    "你好😀世界🎉",
    "😀[uv_break]𠀀你",
    "中文English混合text测试",
    "I love 北京 very much",
    "：；！（）【】『』「」《》－",
    ":;!()<>-",
    "!\"#$%&'()*+,-./:;<=>?@\\^`{|}~",
    "中文!\"#$%&'()*+,-./:;<=>?@\\^`{|}~",
    "為什麼與於満",
    "這個問題為什麼這麼難?",
    "第一行\n第二行\n\n第四行",
    "Line one.\nLine two.",
    "第一句。第二句。第三句",
    "First sentence. Second sentence. Third",
    "e.g.this is not split. but this is",
    "价格是¥100，折扣50%。",
    "email: test@example.com",
    "ÀÉÎõü café naïve",
    "１２３ＡＢＣ全角字符",
    "你好、世界，再见。",
    "  leading and trailing spaces  ",
    "Tabs\tand\r\nCRLF",
    "[uv_break]",
    "[]",
    "[[uv_break]]",
    "]]",
    "[_]你好[ ]",
    "Mr. Smith went to Washington.  He said hi.",
    "2024年1月1日，气温-5°C。",
    "一二三四五六七八九十",
    "ABC abc XYZ",
    "这是一个很长的句子，包含了很多的标点符号：逗号、句号。还有感叹号！问号？以及省略号……",
    "“引号”和‘单引号’",
    "Rock 'n' roll & blues",
    "hello[uv_break]world[laugh]!",
    "\u3000全角空格\u3000",
    "ｈｅｌｌｏ",
    "𠀀𠀁",
    "Ｈｅｌｌｏ，世界！",
    "a1b2 c3[uv_break]4d 你5好[laugh]6",
    "zh 中 en English 英",
    "。.。. 。",
    "End with dot.",
    "End with dot. ",
    "嗯嗯[uv_break]那个[uv_break]我觉得[laugh]挺好的",
]

OPTIONS = list(itertools.product([True, False], [True, False], [None, "zh", "en"]))

# Toy language normalisers; tests/text/test_normalize.py defines the same ones.
_DIGITS = str.maketrans("0123456789", "零一二三四五六七八九")


def toy_en(s: str) -> str:
    return s.upper() + "!"


def toy_zh(s: str) -> str:
    return s.translate(_DIGITS)


def option_key(norm: bool, homo: bool, lang: str | None) -> str:
    return f"{int(norm)}{int(homo)}-{lang}"


def run_all(normalizer: Normalizer, text: str) -> dict[str, object]:
    out: dict[str, object] = {}
    for norm, homo, lang in OPTIONS:
        try:
            out[option_key(norm, homo, lang)] = normalizer(text, norm, homo, lang)
        except Exception as exc:  # the reference crashes on a few inputs
            out[option_key(norm, homo, lang)] = {"error": type(exc).__name__}
    return out


def reference_split(chat: ChatTTS.Chat, text: str) -> list[str]:
    def fake_infer(text, *args, **kwargs):
        yield list(text)

    chat._infer = fake_infer
    return chat.infer(text, refine_text_only=True, split_text=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    here = Path(__file__).resolve().parent.parent
    parser.add_argument("--out", type=Path, default=here / "tests" / "text" / "golden_normalize.json")
    args = parser.parse_args()

    logging.disable(logging.CRITICAL)
    map_path = os.path.join(os.path.dirname(ChatTTS.__file__), "res", "homophones_map.json")
    plain = Normalizer(map_path)
    registered = Normalizer(map_path)
    assert registered.register("en", toy_en) and registered.register("zh", toy_zh)
    chat = ChatTTS.Chat()

    cases = []
    for text in INPUTS:
        cases.append(
            {
                "text": text,
                "split": reference_split(chat, text),
                "detect": plain._detect_language(text),
                "plain": run_all(plain, text),
                "registered": run_all(registered, text),
            }
        )
    doc = {
        "reference": f"chattts=={importlib.metadata.version('chattts')}",
        "generator": "scripts/golden_normalize.py",
        "cases": cases,
    }
    # One case per line keeps the file small and diffs readable.
    body = ",\n".join("  " + json.dumps(c, ensure_ascii=False) for c in cases)
    head = json.dumps({k: v for k, v in doc.items() if k != "cases"}, ensure_ascii=False)[:-1]
    args.out.write_text(f'{head}, "cases": [\n{body}\n]}}\n', encoding="utf-8")
    print(f"wrote {len(cases)} cases x {len(OPTIONS)} option sets to {args.out}")


if __name__ == "__main__":
    main()
