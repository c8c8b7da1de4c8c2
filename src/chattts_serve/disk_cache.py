"""An entry of an on-disk cache (the trunk's ONNX exports, the OpenVINO audio graphs): keyed by the files it was
made from (``files_digest``) and written whole or not at all (``publish``).

The entry is written into a temporary directory beside its place and renamed into it: a reader (another engine
starting on the same cache) sees a whole entry or none. Two writers of the same entry may race; the second
rename fails on the first one's entry, which is as good as its own, and its copy is dropped.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path


def files_digest(root: Path, rels: Iterable[str]) -> str:
    """sha256 over the files ``rels`` under ``root`` (each its relative path, then its content's sha256; a missing
    one is skipped). A file is read once a process while its size and modification time stay: an engine with an
    ``ort-*`` trunk and ``ov-int8`` audio keys both caches on the GPT's weights, ~1 GB at full size."""
    h = hashlib.sha256()
    for rel in rels:
        path = Path(root) / rel
        if path.exists():
            st = path.stat()
            h.update(rel.encode())
            h.update(_content_digest(str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino))
    return h.hexdigest()


@functools.lru_cache(maxsize=64)
def _content_digest(path: str, size: int, mtime_ns: int, inode: int) -> bytes:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").digest()


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
