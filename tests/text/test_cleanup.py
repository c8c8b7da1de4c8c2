"""``clean_markdown``: markdown as a person reads it aloud, on real markdown (an LLM answer, a README)."""

from __future__ import annotations

import pytest

from chattts_serve.text.cleanup import clean_markdown

LLM_ANSWER = """\
## 如何部署 🚀

你可以使用 **[Dapr](https://dapr.io/)** 来管理服务，详见 [官方文档](https://docs.dapr.io/getting-started/)。

- 安装 `dapr` 命令行工具 ✅
- 运行 `dapr init`
* 打开 https://www.example.com/path?x=1#top 查看
1. 有问题请联系 support@example.com 😀

> 注意：*不要*在生产环境中使用 ~~默认~~ 配置。

```bash
dapr run --app-id myapp
```
"""


def test_an_llm_answer():
    assert clean_markdown(LLM_ANSWER).splitlines() == [
        "如何部署",
        "你可以使用 Dapr 来管理服务，详见 官方文档。",
        "安装 dapr 命令行工具",
        "运行 dapr init",
        "打开 example.com 查看",
        "1. 有问题请联系 support at example.com",
        "注意：不要在生产环境中使用 默认 配置。",
        "dapr run --app-id myapp",
    ]


README_EXCERPT = """\
# chattts-serve

A fast, faithful inference engine for the [ChatTTS](https://github.com/2noise/ChatTTS) text-to-speech
model, written in Python on __PyTorch__. It loads the official checkpoint files unchanged.

![logo](docs/logo.png)

| Mode | Speed |
| --- | --- |
| fp32 | 1x |

See the [docs][1] or <https://example.org/guide>.

[1]: https://example.org/docs "Docs"
"""


def test_a_readme():
    assert clean_markdown(README_EXCERPT).splitlines() == [
        "chattts-serve",
        "A fast, faithful inference engine for the ChatTTS text-to-speech",
        "model, written in Python on PyTorch. It loads the official checkpoint files unchanged.",
        "logo",
        "Mode Speed",
        "fp32 1x",
        "See the docs or example.org.",
    ]


@pytest.mark.parametrize(
    ("text", "spoken"),
    [
        ("snake_case_name and 2*3*4 stay", "snake_case_name and 2*3*4 stay"),  # not emphasis
        ("a [bracketed] word and [oral] stay", "a [bracketed] word and [oral] stay"),  # no link target
        ("[link (with parens)](https://x.org/a_(b)) end", "link (with parens) end"),
        ("emoji 👨‍👩‍👧 family, flag 🇨🇳, keycap 1️⃣ done", "emoji family, flag , keycap 1 done"),
        ("", ""),
    ],
)
def test_what_stays_and_what_goes(text, spoken):
    assert clean_markdown(text) == spoken
