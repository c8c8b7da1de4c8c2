"""Voice packs: ``voices/NAME.pt``, a float32 [510, 1, 256] tensor, one style row per phoneme count.

Row ``n - 1`` styles an utterance of ``n`` phonemes; its first half feeds the decoder, the second the
prosody predictor. A blend is the weighted mean of packs (``af_bella(2)+af_sky(1)``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import torch

VoicePack = torch.Tensor  # float32 [510, 1, 256]
PACK_ROWS = 510
VOICE_NAME = re.compile(r"[a-z]{2}_[a-z0-9]+")


class VoiceError(ValueError):
    """A voice name is unknown or malformed, or its file is not a voice pack."""


def voice_names(root: str | Path) -> list[str]:
    """The voices a checkpoint directory holds (``voices/*.pt``), sorted."""
    return sorted(p.stem for p in (Path(root) / "voices").glob("*.pt"))


def load_voice(root: str | Path, name: str, dim: int = 256) -> VoicePack:
    if not VOICE_NAME.fullmatch(name):
        raise VoiceError(f"voice name {name!r} is not of the form xx_name (e.g. af_heart)")
    path = Path(root) / "voices" / f"{name}.pt"
    if not path.is_file():
        known = ", ".join(voice_names(root)) or "none"
        raise VoiceError(f"no voice {name!r} in {Path(root) / 'voices'} (known: {known})")
    pack = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(pack, torch.Tensor) or pack.dim() != 3 or pack.shape[1:] != (1, dim) or pack.shape[0] < 1:
        shape = tuple(pack.shape) if isinstance(pack, torch.Tensor) else type(pack).__name__
        raise VoiceError(f"{path}: expected a [{PACK_ROWS}, 1, {dim}] tensor, got {shape}")
    return pack.to(torch.float32)


def blend_voices(parts: Sequence[tuple[VoicePack, float]]) -> VoicePack:
    """The weighted mean of packs: sum(w_i * pack_i) / sum(w_i)."""
    if not parts:
        raise VoiceError("a blend needs at least one voice")
    if any(not w > 0 for _, w in parts):
        raise VoiceError("blend weights must be positive")
    shapes = {tuple(p.shape) for p, _ in parts}
    if len(shapes) != 1:
        raise VoiceError(f"cannot blend packs of different shapes {sorted(shapes)}")
    total = sum(w for _, w in parts)
    return sum(p * (w / total) for p, w in parts)


def style_for(pack: VoicePack, n_phonemes: int) -> torch.Tensor:
    """The [1, 256] style row for an utterance of ``n_phonemes`` phonemes (boundaries not counted)."""
    if not 1 <= n_phonemes <= pack.shape[0]:
        raise VoiceError(f"a voice pack styles 1..{pack.shape[0]} phonemes, got {n_phonemes}")
    return pack[n_phonemes - 1]
