"""The package's outputs for the front-end's cases (scripts/kokoro_text_goldens.py) and the public vocab."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

from chattts_serve.models.kokoro.text import MAX_PHONEMES

HERE = Path(__file__).resolve().parent


@cache
def golden() -> dict:
    return json.loads((HERE / "golden_kokoro_text.json").read_text(encoding="utf-8"))


@cache
def vocab() -> dict[str, int]:
    """hexgrad/Kokoro-82M config.json's ``vocab`` (114 symbols; ids up to 177 of ``n_token`` 178)."""
    return json.loads((HERE / "vocab.json").read_text(encoding="utf-8"))


def _squash(s: str) -> str:
    return "".join(s.split())


def assert_chunks_match(ours, theirs: list[dict]) -> None:
    """Our chunks of one text against the package's (``KPipeline(lang_code="z")``'s results)."""
    if all(len(c["untruncated"]) <= MAX_PHONEMES for c in theirs):
        got = [{"graphemes": c.text, "phonemes": c.phonemes, "text_index": c.text_index} for c in ours]
        assert got == [{k: c[k] for k in ("graphemes", "phonemes", "text_index")} for c in theirs]
        return
    # The package truncates this chunk's phonemes to 510 (speech lost): ours are cut at punctuation
    # instead, every chunk within 510, together the package's whole string.
    assert len(theirs) == 1 and len(ours) > 1
    assert all(len(c.phonemes) <= MAX_PHONEMES for c in ours)
    assert _squash("".join(c.phonemes for c in ours)) == _squash(theirs[0]["untruncated"])
    assert theirs[0]["phonemes"].startswith(ours[0].phonemes)
    assert ours[0].phonemes[-1] in ".!?,;:"  # cut after a mark (KPipeline.waterfall_last)
