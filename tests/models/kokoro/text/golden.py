"""The package's outputs for the front-end's cases (scripts/kokoro_text_goldens.py) and the public vocab."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

HERE = Path(__file__).resolve().parent


@cache
def golden() -> dict:
    return json.loads((HERE / "golden_kokoro_text.json").read_text(encoding="utf-8"))


@cache
def vocab() -> dict[str, int]:
    """hexgrad/Kokoro-82M config.json's ``vocab`` (114 symbols; ids up to 177 of ``n_token`` 178)."""
    return json.loads((HERE / "vocab.json").read_text(encoding="utf-8"))
