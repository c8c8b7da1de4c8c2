"""The code examples of the ``docs/`` pages, run as tests: a page's copy-paste example is only as good
as its last run.

A page marks an example for testing with an HTML comment right above its fence (invisible on GitHub):

    <!-- test: openai-speech -->
    ```python
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    ...
    ```

``tagged_blocks("openai.md")`` returns ``{"openai-speech": code, ...}``; ``run_block(code, cwd,
{DOC_URL: server})`` runs one in a fresh interpreter (this venv's) with the page's addresses replaced by
a test server's, and returns its stdout. Any page's test module can use them::

    from tests.docs.doc_blocks import DOC_URL, run_block, tagged_blocks
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"
DOC_URL = "http://127.0.0.1:8000"
"""The server address every page's examples use (``chattts-serve serve``'s default)."""
BLOCK_TIMEOUT = 300

# The marker, then (after blank lines at most) a fenced block of the language; the fence may be
# indented (inside a list item), and the block ends at the first fence line of the same indent.
_TAGGED = re.compile(
    r"^[ \t]*<!--\s*test:\s*(?P<name>[A-Za-z0-9_.-]+)\s*-->[ \t]*\n(?:[ \t]*\n)*"
    r"(?P<indent>[ \t]*)```(?P<lang>[A-Za-z0-9_+-]*)[^\n]*\n(?P<code>.*?)^(?P=indent)```[ \t]*$",
    re.MULTILINE | re.DOTALL,
)
_MARKER = re.compile(r"<!--\s*test:\s*([^\s>]+)")


def tagged_blocks(page: str | Path, lang: str = "python") -> dict[str, str]:
    """``{name: code}`` of the blocks of ``lang`` tagged ``<!-- test: NAME -->`` in ``page`` (a path,
    or a file name in ``docs/``), in page order. A marker not followed by a fenced block, a block of
    another language, or a name used twice is an error: a tag never silently tests nothing."""
    path = Path(page) if Path(page).is_absolute() or Path(page).exists() else DOCS / page
    text = path.read_text(encoding="utf-8")
    blocks: dict[str, str] = {}
    for m in _TAGGED.finditer(text):
        name, code = m.group("name"), m.group("code")
        if m.group("lang") != lang:
            continue
        if name in blocks:
            raise ValueError(f"{path.name}: test name {name!r} is used twice")
        indent = m.group("indent")
        blocks[name] = "".join(line.removeprefix(indent) for line in code.splitlines(keepends=True))
    tagged = set(_MARKER.findall(text))
    found = {m.group("name") for m in _TAGGED.finditer(text)}
    if tagged - found:
        raise ValueError(f"{path.name}: marker(s) {sorted(tagged - found)} not followed by a fenced code block")
    return blocks


def substitute(code: str, replacements: dict[str, str]) -> str:
    """``code`` with each key replaced by its value; a key that is not in the code is an error (the
    example would otherwise reach the documented address instead of the test server)."""
    for old, new in replacements.items():
        if old not in code:
            raise ValueError(f"{old!r} does not occur in the example:\n{code}")
        code = code.replace(old, new)
    return code


def run_block(
    code: str,
    cwd: Path,
    replacements: dict[str, str] | None = None,
    *,
    timeout: float = BLOCK_TIMEOUT,
    env: dict[str, str] | None = None,
) -> str:
    """Run one example as a script (``python -c``) in ``cwd``; returns its stdout. A non-zero exit fails
    with the example's stderr in the message."""
    code = substitute(code, replacements or {})
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONIOENCODING": "utf-8", **(env or {})},
        capture_output=True,
        text=True,
        encoding="utf-8",
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise AssertionError(f"example exited with {proc.returncode}:\n{code}\n--- stderr:\n{proc.stderr[-4000:]}")
    return proc.stdout
