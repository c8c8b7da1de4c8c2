"""Run our tokenizer and model on the fidelity cases, keyed as the oracle keys its outputs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from chattts_serve.models.vits.checkpoint import load
from chattts_serve.models.vits.model import Utterance
from chattts_serve.models.vits.tokenizer import VitsTokenizer


def ours(ckpt: Path, texts: list[str], cases: list[dict]) -> dict[str, np.ndarray]:
    tokenizer = VitsTokenizer.from_dir(ckpt)
    model = load(ckpt)
    out: dict[str, np.ndarray] = {}
    for i, text in enumerate(texts):
        out[f"texts/{i}/ids"] = np.array(tokenizer.encode(text), dtype=np.int64)
    for i, case in enumerate(cases):
        ids = case["ids"] if "ids" in case else tokenizer.encode(case["text"])
        utt = Utterance(ids, case["speaking_rate"], case["noise_scale"], case["noise_scale_duration"],
                        torch.Generator().manual_seed(case["seed"]), case.get("speaker_id"))
        syn = model.synthesize([utt])[0]
        out[f"{i}/ids"] = np.array(ids, dtype=np.int64)
        out[f"{i}/durations"] = syn.durations.numpy()
        out[f"{i}/audio"] = syn.audio.numpy()
    return out


def differences(reference: dict[str, np.ndarray], mine: dict[str, np.ndarray]) -> dict[str, float]:
    """Per key of ``reference``: max |ours - reference| (inf on a shape mismatch, 0 for equal integers)."""
    report = {}
    for key, ref in reference.items():
        if key.startswith("meta/") or key.endswith(("_len", "_sha256")):
            continue
        a = mine[key]
        report[key] = float(np.abs(a.astype(np.float64) - ref).max()) if a.shape == ref.shape and a.size else (
            0.0 if a.shape == ref.shape else float("inf"))
    return report
