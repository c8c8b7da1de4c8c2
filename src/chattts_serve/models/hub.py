"""Where a family's checkpoint comes from: a local directory, or a Hugging Face repo id fetched (and cached)
on demand. One rule for every family, so a missing file, a path that is not a repo id and an offline hub read
the same whatever the model; each family names its files, its hub patterns and its advice."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path


def local_or_hub(
    path_or_repo: str | os.PathLike,
    revision: str | None,
    *,
    required: Sequence[str],
    patterns: Sequence[str],
    error: type[Exception],
    kind: str,
    offline_advice: Callable[[str], str],
) -> Path:
    """A complete local checkpoint directory: ``path_or_repo`` itself (every file of ``required`` present), or
    the repo's ``patterns`` downloaded and then checked the same way. Raises ``error``: ``kind`` names the
    directory in messages ("Kokoro checkpoint directory"); ``offline_advice(repo)`` follows a failed download
    (network, auth, offline mode: one clear message, no traceback)."""
    path = Path(path_or_repo).expanduser()
    if path.exists():
        if not path.is_dir():
            raise error(f"{path} is a file; expected a {kind}")
        missing = [f for f in required if not (path / f).is_file()]
        if missing:
            raise error(f"{kind} {path} is incomplete; missing: {', '.join(missing)}")
        return path
    repo = str(path_or_repo)
    if repo.startswith((".", "/", "~")) or not re.fullmatch(r"[\w.-]+/[\w.-]+", repo):
        raise error(f"no checkpoint directory {str(path)!r} (and it is not a Hugging Face repo id)")
    from huggingface_hub import snapshot_download

    try:
        root = snapshot_download(repo_id=repo, revision=revision, allow_patterns=list(patterns))
    except Exception as exc:
        raise error(f"could not get {repo!r} ({type(exc).__name__}: {exc}). {offline_advice(repo)}") from None
    return local_or_hub(
        root, None, required=required, patterns=patterns, error=error, kind=kind, offline_advice=offline_advice
    )


def checkpoint_config(root: str | os.PathLike, config_file: str, weights_file: str) -> dict | None:
    """The parsed ``config_file`` of a directory that holds ``weights_file`` beside it; None when either is
    missing or the config is not a JSON object. Reads no weights: families detect their checkpoints with it."""
    root = Path(root)
    if not (root / weights_file).is_file() or not (root / config_file).is_file():
        return None
    try:
        raw = json.loads((root / config_file).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None
