"""An entry of an on-disk cache (the trunk's ONNX exports, the OpenVINO audio graphs) written whole or not at all.

The entry is written into a temporary directory beside its place and renamed into it: a reader (another engine
starting on the same cache) sees a whole entry or none. Two writers of the same entry may race; the second
rename fails on the first one's entry, which is as good as its own, and its copy is dropped.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def publish(final: Path, write: Callable[[Path], None], complete: str) -> None:
    """``write(directory)`` fills a temporary directory that becomes ``final``; ``complete``: the file name whose
    presence in ``final`` marks a whole entry (a concurrent writer's). An existing ``final`` is replaced."""
    base = final.parent
    base.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=base))
    try:
        write(tmp)
        if final.exists():  # an old or damaged entry the caller chose to replace
            shutil.rmtree(final, ignore_errors=True)
        try:
            os.replace(tmp, final)  # atomic: a reader sees a whole entry or none
        except OSError:
            if not (final / complete).exists():  # not a concurrent writer that got there first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
