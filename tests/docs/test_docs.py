"""The docs/ pages: the index links every integration page, every tagged example compiles, and the
helper that pulls tagged examples out of a page (``doc_blocks``) finds exactly what is tagged."""

from __future__ import annotations

import re

import pytest

from .doc_blocks import DOCS, substitute, tagged_blocks

INTEGRATIONS = ("openai.md", "pipecat.md", "livekit.md", "wyoming.md", "ray.md")
_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _pages() -> list:
    return sorted(p for p in DOCS.glob("*.md") if p.name != "README.md")


def test_index_links_every_page():
    index = (DOCS / "README.md").read_text(encoding="utf-8")
    links = {link for link in _LINK.findall(index) if "://" not in link}
    for page in INTEGRATIONS:
        assert page in links, f"docs/README.md does not link {page}"
    for page in _pages():
        assert page.name in links, f"docs/README.md does not link {page.name}"
    missing = sorted(link for link in links if not (DOCS / link).exists())
    assert not missing, f"docs/README.md links pages that do not exist: {missing}"


@pytest.mark.parametrize("page", [p.name for p in _pages()])
def test_tagged_examples_compile(page):
    blocks = tagged_blocks(page)
    for name, code in blocks.items():
        compile(code, f"{page}:{name}", "exec")


def test_tagged_blocks(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n"
        "<!-- test: first -->\n```python\nprint(1)\n```\n\n"
        "```python\nprint('untagged')\n```\n\n"
        "1. In a list:\n\n"
        "   <!-- test: second -->\n\n   ```python\n   if True:\n       print(2)\n   ```\n\n"
        "<!-- test: shell -->\n```bash\necho 3\n```\n",
        encoding="utf-8",
    )
    assert tagged_blocks(page) == {"first": "print(1)\n", "second": "if True:\n    print(2)\n"}
    assert tagged_blocks(page, lang="bash") == {"shell": "echo 3\n"}


@pytest.mark.parametrize(
    "text, error",
    [
        ("<!-- test: lost -->\nsome prose\n```python\nprint(1)\n```\n", "not followed by a fenced code block"),
        ("<!-- test: a -->\n```python\nx = 1\n```\n<!-- test: a -->\n```python\nx = 2\n```\n", "used twice"),
    ],
)
def test_tagged_blocks_refuse_mistakes(tmp_path, text, error):
    page = tmp_path / "page.md"
    page.write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match=error):
        tagged_blocks(page)


def test_substitute_needs_the_documented_address():
    assert substitute('OpenAI(base_url="http://127.0.0.1:8000/v1")', {"http://127.0.0.1:8000": "http://h:1"}) == (
        'OpenAI(base_url="http://h:1/v1")'
    )
    with pytest.raises(ValueError, match="does not occur"):
        substitute("print(1)", {"http://127.0.0.1:8000": "http://h:1"})
