"""Run our model on the fidelity cases and compare with the package's outputs (golden or live)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from chattts_serve.models.kokoro.checkpoint import load
from chattts_serve.models.kokoro.model import Utterance
from chattts_serve.models.kokoro.voices import load_voice, style_for

FIELDS = ("durations", "f0", "energy", "audio")


def ours(ckpt: Path, cases: list[dict]) -> dict[str, np.ndarray]:
    """Our outputs, keyed as the oracle keys its own (``i/audio``...), each case alone with its seed."""
    model = load(ckpt)
    out = {}
    for i, case in enumerate(cases):
        pack = load_voice(ckpt, case["voice"])
        utt = Utterance(case["ids"], style_for(pack, len(case["ids"]) - 2), case["speed"],
                        torch.Generator().manual_seed(case["seed"]))
        syn = model.synthesize([utt])[0]
        for name in FIELDS:
            out[f"{i}/{name}"] = getattr(syn, name).numpy()
    return out


def max_differences(reference: dict[str, np.ndarray], cases: list[dict], ckpt: Path) -> dict[str, float]:
    """Per ``i/field``: max |ours - reference| (inf on a shape mismatch)."""
    mine = ours(ckpt, cases)
    report = {}
    for i in range(len(cases)):
        for name in FIELDS:
            key = f"{i}/{name}"
            a, b = mine[key], reference[key]
            report[key] = float(np.abs(a.astype(np.float64) - b).max()) if a.shape == b.shape else float("inf")
    return report
