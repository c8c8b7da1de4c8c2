"""Goldens for Kokoro's text front-end from the package itself (kokoro==0.9.4, misaki==0.9.4).

Two halves in one file:

* ``--oracle`` runs in the reference environment (``bash ../shared/oracle/setup_venv.sh DIR``): it reads
  a request (JSON) on stdin and writes the package's answers on stdout. ``zh``: for each text, the
  chunks ``KPipeline(lang_code="z", model=False)`` yields (graphemes, phonemes, text_index), and misaki's
  ``ZHG2P()`` string for each chunk's graphemes (what the package truncates to 510 when longer).
  ``espeak``: ``misaki.espeak.EspeakG2P`` on each English text. ``en_tokenize``: the chunks
  ``KPipeline.en_tokenize`` makes of tokens (graphemes, phonemes, token count). ``join``: ``KPipeline.join_timestamps``
  on tokens (text, phonemes, whitespace) and predicted durations, each token's (start_ts, end_ts).
  Imports no chattts_serve.
* without it (our environment), it builds the cases (the Chinese texts come from our front-end tests;
  the join cases are our English chunks with seeded random durations), asks the reference python
  (``CHATTTS_REFERENCE_PYTHON`` or ``--reference``) and writes the golden file the fast tests read:

    PYTHONPATH=src python scripts/kokoro_text_goldens.py --reference .venv-reference/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "models" / "kokoro" / "text" / "golden_kokoro_text.json"

# Chinese texts of our front-end tests (tests/text, tests/fidelity): numbers, dates, money, percent,
# full-width forms, quotes, brackets, emoji, mixed English, several lines.
ZH_TEXTS = [
    "今天天气真不错，我们一起去公园散步吧。",
    "你好，很高兴认识你。",
    "这是一个测试",
    "我今天买了3个苹果，花了12.5元。",
    "2024年1月1日，气温-5°C。",
    "价格是¥100，折扣50%。",
    "I love 北京 very much.",
    "中文English混合text测试",
    "你可以使用 Dapr 来管理服务，详见 官方文档。",
    "打开 example.com 查看",
    "1. 有问题请联系 support at example.com",
    "注意：不要在生产环境中使用 默认 配置。",
    "“引号”和‘单引号’",
    "１２３ＡＢＣ全角字符",
    "Ｈｅｌｌｏ，世界！",
    "　全角空格　",
    "你好😀世界🎉",
    "你好!今天天气怎么样?",
    "你好、世界，再见。",
    "這個問題為什麼這麼難?",
    "还有感叹号！问号？以及省略号……",
    "这是一个很长的句子，包含了很多的标点符号：逗号、句号。还有感叹号！问号？以及省略号……",
    "四川美食确实以辣闻名，但也有不辣的选择。比如甜水面、赖汤圆。",
    "电话+86 138-0013，2024年3月15日",
    "第一行\n第二行\n\n第四行",
    "重庆银行 万维网 长城",
    # sentences grouped into <= 400 characters at ASCII marks, each group within 510 phonemes
    "This is sentence number one of many, 你好. " * 12,
    # a Chinese paragraph whose phonemes pass 510: the package truncates it, we cut it at punctuation
    "四川美食确实以辣闻名，但也有不辣的选择。比如甜水面、赖汤圆、钟水饺和龙抄手，都是清淡可口的小吃。" * 4,
]

EN_TEXTS = [
    "Hello world, this is a test of chat tts.",
    "Good morning, how are you today?",
    "Dr. Smith paid $42 on 3/4/2024! (Really?) \"Yes.\"",
    "The quick brown fox jumps over the lazy dog; then it rests: quietly, calmly.",
    # past 510 phonemes: KPipeline.en_tokenize cuts it (waterfall), a chunk ends on a token with a space
    "The quick brown fox jumps over the lazy dog; then it rests: quietly, calmly. " * 8,
    "One, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve (thirteen), fourteen " * 6,
]


def oracle(request: dict) -> dict:
    import torch
    from kokoro import KPipeline
    from misaki.espeak import EspeakG2P
    from misaki.token import MToken
    from misaki.zh import ZHG2P

    zh = KPipeline(lang_code="z", repo_id="hexgrad/Kokoro-82M", model=False)
    zh_g2p = ZHG2P()
    out: dict = {"zh": [], "espeak": {}, "join": [], "en_tokenize": []}
    for text in request.get("zh", []):
        out["zh"].append([
            {"graphemes": r.graphemes, "phonemes": r.phonemes, "text_index": r.text_index,
             "untruncated": zh_g2p(r.graphemes)[0]}
            for r in zh(text)
        ])
    for lang, texts in request.get("espeak", {}).items():
        g2p = EspeakG2P(language=lang)
        out["espeak"][lang] = [g2p(t)[0] for t in texts]
    for case in request.get("en_tokenize", []):
        tokens = [MToken(text=t, tag="", whitespace=w, phonemes=p) for t, p, w in case]
        out["en_tokenize"].append([[gs, ps, len(tks)] for gs, ps, tks in zh.en_tokenize(tokens)])
    for case in request.get("join", []):
        tokens = [MToken(text=t, tag="", whitespace=w, phonemes=p) for t, p, w in case["tokens"]]
        KPipeline.join_timestamps(tokens, torch.tensor(case["durations"], dtype=torch.long))
        out["join"].append([[t.start_ts, t.end_ts] for t in tokens])
    return out


def ask(reference_python: str, request: dict, timeout: float = 600) -> dict:
    """Runs ``--oracle`` in the reference environment (from our side, e.g. the live tests)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONIOENCODING": "utf-8"}
    env.pop("PYTHONPATH", None)
    done = subprocess.run(
        [reference_python, str(Path(__file__).resolve()), "--oracle"], input=json.dumps(request),
        capture_output=True, text=True, timeout=timeout, check=True, env=env, encoding="utf-8",
    )
    return json.loads(done.stdout)


def token_cases() -> list[list[list[str]]]:
    """Our English tokens (espeak-ng G2P, American) of each text, in the package's MToken terms."""
    from chattts_serve.models.kokoro.text import G2P

    g2p = G2P("a", english="espeak")
    return [[[t.text, t.phonemes, t.text_space] for t in g2p.tokens(text)] for text in EN_TEXTS]


def join_cases(seed: int = 0) -> list[dict]:
    """Our English chunks (espeak-ng G2P) with random durations, in the package's MToken terms."""
    from chattts_serve.models.kokoro.text import G2P, chunk_text

    rng = random.Random(seed)
    cases = []
    for lang in ("a", "b"):
        g2p = G2P(lang, english="espeak")
        for text in EN_TEXTS:
            for chunk in chunk_text(g2p, text):
                durations = [rng.randint(0, 12) for _ in range(len(chunk.phonemes) + 2)]
                tokens = [[t.text, t.phonemes, t.text_space] for t in chunk.tokens]
                cases.append({"lang": lang, "text": text, "tokens": tokens, "durations": durations})
    return cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--oracle", action="store_true", help="answer a request on stdin (reference environment)")
    ap.add_argument("--reference", default=os.environ.get("CHATTTS_REFERENCE_PYTHON"))
    ap.add_argument("--out", type=Path, default=GOLDEN)
    args = ap.parse_args()
    if args.oracle:
        json.dump(oracle(json.load(sys.stdin)), sys.stdout, ensure_ascii=False)
        return
    if not args.reference:
        ap.error("--reference (or CHATTTS_REFERENCE_PYTHON): the reference environment's python")
    join, tokens = join_cases(), token_cases()
    request = {"zh": ZH_TEXTS, "espeak": {"en-us": EN_TEXTS, "en-gb": EN_TEXTS}, "join": join, "en_tokenize": tokens}
    answer = ask(args.reference, request)
    golden = {
        "package": "kokoro==0.9.4, misaki==0.9.4",
        "zh": [{"text": t, "chunks": c} for t, c in zip(ZH_TEXTS, answer["zh"], strict=True)],
        "espeak": {lang: [{"text": t, "phonemes": p} for t, p in zip(EN_TEXTS, ps, strict=True)]
                   for lang, ps in answer["espeak"].items()},
        "join": [{**case, "times": times} for case, times in zip(join, answer["join"], strict=True)],
        "en_tokenize": [{"text": text, "tokens": tks, "chunks": chunks}
                        for text, tks, chunks in zip(EN_TEXTS, tokens, answer["en_tokenize"], strict=True)],
    }
    args.out.write_text(json.dumps(golden, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out}: {len(golden['zh'])} zh texts, {len(golden['join'])} join cases")


if __name__ == "__main__":
    main()
