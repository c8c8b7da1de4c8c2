"""No merge-conflict markers in any tracked text file (one landed in the README's module table once)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(rb"^(<{7} |={7}$|>{7} )", re.MULTILINE)


def test_no_tracked_file_holds_a_conflict_marker():
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, timeout=60)
    if files.returncode != 0:
        pytest.skip("not a git checkout")
    bad = []
    for name in files.stdout.decode().split("\0"):
        path = ROOT / name
        if not name or not path.is_file() or path.stat().st_size > 5_000_000:
            continue
        data = path.read_bytes()
        if b"\0" in data[:4096]:  # binary
            continue
        for m in MARKER.finditer(data):
            line = data[: m.start()].count(b"\n") + 1
            bad.append(f"{name}:{line}")
    assert not bad, f"merge-conflict markers at {', '.join(bad)}"
