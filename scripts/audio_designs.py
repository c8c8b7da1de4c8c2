"""The audio graph's int8 designs against ov-bf16 (issue 33 item 2): speed on one thread and SNR against torch
fp32 on the same hidden states.

    PYTHONPATH=src python scripts/audio_designs.py --model CKPT [--rounds 5] [--variants a,b]  # one JSON line

Hidden states: ``randn`` (``bench audio``'s: unit Gaussian) and ``model``: what the trunk itself makes, the
fp32 GPT teacher-forced over a text prompt and codes it sampled itself (``Engine.synthesize``, refine off;
random weights: numerical fidelity, not perceived quality). Calibration (the static variants) uses other
texts than the evaluation: the trunk over a prompt and random codes (``audio.quantize.calibration_hidden``).

Variants (all on OpenVINO's CPU plugin, one thread; what is not int8 computes in bf16):
  ov-bf16        today's graph
  int8-all       nncf post-training quantization of every conv and MatMul (PERFORMANCE preset)
  int8-linears   only the ConvNeXt blocks' pointwise linears in int8 (MIXED preset: asymmetric activations
                 after GELU); depthwise/in/out convs and the head's projection bf16
  int8-smooth    int8-linears with SmoothQuant (nncf's TRANSFORMER model type, alpha per ``--alpha``)
  NAME-f32       that variant with f32 where it is not int8 (ov-f32: today's ov-fp32)
  dyn-g{N}       weights int8 (nncf.compress_weights, per channel), activations quantized by the plugin at run
                 time in groups of N (DYNAMIC_QUANTIZATION_GROUP_SIZE): no calibration
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch


def model_hidden(ckpt: str, steps: int, texts: list[str], cache: Path) -> list[torch.Tensor]:
    """The fp32 trunk's hidden states for ``texts`` ([steps, hidden] each), cached in ``cache``."""
    if cache.exists():
        return torch.load(cache)
    from chattts_serve import Engine
    from chattts_serve.bench.eval import _free_run, _prompt_ids, teacher_forced
    from chattts_serve.engine.config import EngineConfig

    eng = Engine.from_pretrained(ckpt, "cpu", EngineConfig.with_slots(1))
    codes = _free_run(eng, texts, steps, 7)
    out = [teacher_forced(eng, _prompt_ids(eng, t), c)[0].float() for t, c in zip(texts, codes, strict=True)]
    torch.save(out, cache)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--variants", default="ov-bf16,int8-all,int8-linears,int8-smooth,dyn-g32,dyn-g128")
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--cache", default="/tmp/audio50_hidden.pt")
    args = p.parse_args()
    torch.set_num_threads(1)

    from chattts_serve.audio import cpu_graph, quantize
    from chattts_serve.audio.decode import _decode_batch
    from chattts_serve.bench.common import TEXTS
    from chattts_serve.bench.stats import snr_db
    from chattts_serve.models.chattts.checkpoint import load
    from chattts_serve.models.chattts.vocos import istft, spectrum_of_projection

    model = load(args.model)
    t0 = time.perf_counter()
    hid = model_hidden(args.model, args.steps, [TEXTS[i] for i in (1, 2)], Path(args.cache))
    t_hidden = time.perf_counter() - t0
    g = torch.Generator().manual_seed(0)
    inputs = {
        "randn": torch.randn(1, args.steps, model.config.gpt.hidden_size, generator=g),
        **{f"model{i}": h[None, : args.steps] for i, h in enumerate(hid)},
    }
    with torch.inference_mode():
        refs = {k: _decode_batch(model, h, "fp32", None) for k, h in inputs.items()}
    scale = {k: round(float(h.std()), 3) for k, h in inputs.items()}
    t0 = time.perf_counter()
    calib = quantize.calibration_hidden(model)
    t_calib = time.perf_counter() - t0
    base = cpu_graph.convert(model)
    head = model.vocos.head
    runs, notes = {}, {}
    for v in args.variants.split(","):
        t0 = time.perf_counter()
        try:
            prec = "f32" if v.endswith("-f32") else "bf16"
            name = v.removesuffix("-f32")
            if name.startswith("dyn-g"):
                graph = quantize.quantize(base.clone(), calib, "dynamic")
                extra = {"DYNAMIC_QUANTIZATION_GROUP_SIZE": int(name[5:])}
            elif name.startswith("ov-"):
                graph, extra = base, {}
            else:
                graph = quantize.quantize(base.clone(), calib, name[5:], alpha=args.alpha)
                extra = {}
            run = cpu_graph.compile_graph(graph, prec, 1, extra)
        except Exception as exc:  # noqa: BLE001 - reported, the others still run
            notes[v] = f"{type(exc).__name__}: {exc}"[:300]
            continue
        notes[v] = f"built in {time.perf_counter() - t0:.1f} s"
        runs[v] = run

    def decode(run, h):
        x = torch.from_numpy(np.asarray(run(np.ascontiguousarray(h.numpy()))))
        spec = spectrum_of_projection(x)
        return istft(spec, head.istft.window, head.envelope(spec.shape[2]))

    snr = {v: {k: round(snr_db(refs[k], decode(r, h)), 2) for k, h in inputs.items()} for v, r in runs.items()}
    times = {v: [] for v in runs}
    h = inputs["model0"]
    for _ in range(args.rounds):
        for v, r in runs.items():
            t0 = time.perf_counter()
            decode(r, h)
            times[v].append(time.perf_counter() - t0)
    audio_s = (512 * args.steps - 256) / 24000
    result = {
        "window": f"1x{args.steps}",
        "rounds": args.rounds,
        "hidden_std": scale,
        "hidden_s": round(t_hidden, 1),
        "calibration_s": round(t_calib, 1),
        "variants": {
            v: {
                "ms": round(1e3 * statistics.median(times[v]), 1),
                "x_realtime": round(audio_s / statistics.median(times[v]), 1),
                "snr_db": snr[v],
                "note": notes[v],
            }
            for v in runs
        },
        "failed": {v: n for v, n in notes.items() if v not in runs},
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
