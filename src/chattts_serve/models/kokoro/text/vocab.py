"""Phonemes to Kokoro's input ids, as ``KModel.forward`` maps them."""

from __future__ import annotations

from collections.abc import Mapping

from chattts_serve.models.kokoro.text.tokens import MAX_PHONEMES

BOUNDARY_ID = 0
"""``KModel.forward`` wraps the ids in ``[0, ..., 0]``: id 0 is the pad symbol ``$`` of the vocab."""


def phonemes_to_ids(phonemes: str, vocab: Mapping[str, int]) -> list[int]:
    """``[0, *ids, 0]``; a symbol the vocab lacks is dropped, as the package drops it.

    The package counts the phoneme string (unknown symbols included) for chunking and for the voice
    pack's row, and drops the unknown symbols only here: callers keep ``len(phonemes)`` for the style.
    """
    ids = [vocab[p] for p in phonemes if p in vocab]
    if len(ids) > MAX_PHONEMES:
        raise ValueError(f"{len(ids)} phonemes exceed Kokoro's context of {MAX_PHONEMES}")
    return [BOUNDARY_ID, *ids, BOUNDARY_ID]


def unknown_symbols(phonemes: str, vocab: Mapping[str, int]) -> list[str]:
    """The symbols of ``phonemes`` the vocab lacks, each once, in order of appearance."""
    return list(dict.fromkeys(p for p in phonemes if p not in vocab))


def check_phonemes(phonemes: str, vocab: Mapping[str, int]) -> str:
    """Validates a caller's ``phonemes`` input (exact control: nothing is dropped silently)."""
    if not phonemes.strip():
        raise ValueError("phonemes: empty")
    bad = unknown_symbols(phonemes, vocab)
    if bad:
        shown = ", ".join(f"{s!r} (U+{ord(s):04X})" for s in bad)
        raise ValueError(f"phonemes: symbols not in Kokoro's vocabulary: {shown}")
    if len(phonemes) > MAX_PHONEMES:
        raise ValueError(f"phonemes: {len(phonemes)} symbols exceed Kokoro's context of {MAX_PHONEMES}")
    return phonemes
