"""Run the reference ``kokoro`` package (0.9.4) on a list of cases; run with the reference python.

    .venv-reference/bin/python scripts/kokoro_reference_oracle.py CKPT_DIR CASES.json OUT.npz

A case is {"ids": [0, ..., 0], "voice": "af_heart", "speed": 1.0, "seed": 7}. For each, the style is the
voice pack's row for the phoneme count (len(ids) - 2), ``torch.manual_seed(seed)`` seeds the global
generator (the sine source's draws), and ``KModel.forward_with_tokens`` runs in fp32 on the CPU with one
thread. The package's model is built by ``load_model`` of src/chattts_serve/models/kokoro/reference_bench.py
(a standalone file: read by path, so nothing of chattts_serve is imported), which builds its decoder at the
checkpoint's widths where config.json sets them (tiny test checkpoints). Stored per case i: ``i/audio``,
``i/durations``, ``i/f0``, ``i/energy`` (F0Ntrain's outputs, recorded by wrapping the method).
Never imported by the package or the tests: they run it as a subprocess.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import torch

_BENCH = Path(__file__).resolve().parents[1] / "src" / "chattts_serve" / "models" / "kokoro" / "reference_bench.py"


def load_model(ckpt: Path):
    spec = importlib.util.spec_from_file_location("kokoro_reference_bench", _BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.load_model(ckpt)


def main() -> None:
    ckpt, cases_path, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    torch.set_num_threads(1)
    cases = json.loads(cases_path.read_text())
    model = load_model(ckpt)
    curves: list[tuple[torch.Tensor, torch.Tensor]] = []
    f0ntrain = model.predictor.F0Ntrain

    def recording(x, s):
        f0, n = f0ntrain(x, s)
        curves.append((f0, n))
        return f0, n

    model.predictor.F0Ntrain = recording
    arrays = {}
    for i, case in enumerate(cases):
        pack = torch.load(ckpt / "voices" / f"{case['voice']}.pt", map_location="cpu", weights_only=True)
        ids = torch.LongTensor([case["ids"]])
        ref_s = pack[len(case["ids"]) - 2 - 1]
        curves.clear()
        torch.manual_seed(case["seed"])
        audio, durations = model.forward_with_tokens(ids, ref_s, case["speed"])
        arrays[f"{i}/audio"] = audio.numpy()
        arrays[f"{i}/durations"] = durations.reshape(-1).numpy()
        arrays[f"{i}/f0"] = curves[0][0].reshape(-1).numpy()
        arrays[f"{i}/energy"] = curves[0][1].reshape(-1).numpy()
    np.savez_compressed(out, **arrays)


if __name__ == "__main__":
    main()
