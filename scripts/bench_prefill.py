"""Prefill of a burst of admissions: N prompts of ~L tokens (a speaker each) through the runner's torch
prefill one sequence per call (what the runner did before it batched) vs all in one packed call;
medians of --repeats alternating runs in one process.

    python scripts/bench_prefill.py --model CKPT [--prompts 16] [--tokens 60] [--precision fp32]
        [--device cpu] [--threads 1] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from chattts_serve.engine.config import EngineConfig
from chattts_serve.engine.plan import resolve_plan
from chattts_serve.engine.request import Sequence
from chattts_serve.engine.runner import ModelRunner, SeqInputs, StepSampling
from chattts_serve.kernels.quant import parse_precision
from chattts_serve.models.chattts import checkpoint
from chattts_serve.models.chattts.prepare import prepare_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--tokens", type=int, default=60, help="mean prompt length (lengths spread +-5)")
    p.add_argument("--precision", default="fp32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model = checkpoint.load(args.model, device=device)
    layout = prepare_model(model, parse_precision(args.precision), args.prompts)
    cfg = model.config.gpt
    plan = resolve_plan(EngineConfig(precision=args.precision), device.type)
    runner = ModelRunner(model, layout, args.prompts, args.tokens + 16, 3, plan)
    gen = torch.Generator().manual_seed(0)
    seqs = []
    for i in range(args.prompts):
        n = args.tokens - 5 + i % 11
        ids = torch.randint(10, cfg.num_text_tokens, (n,), generator=gen).tolist()
        ids[1] = 7  # the speaker's position
        spk = torch.randn(cfg.hidden_size, generator=gen)
        inp = SeqInputs(ids, StepSampling((0.3,), 0.7, 20, 1.05, 5), (spk / spk.norm()).to(device), 7)
        seq = Sequence("bench", "code", n, 0, 8, 625, seeded=True, retry_empty=False, payload=inp)
        seq.slot = i
        seqs.append(seq)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    runs = {
        "one_per_call": lambda: [runner.prefiller.trunk_outputs([s]) for s in seqs],
        "batched": lambda: runner.prefiller.trunk_outputs(seqs),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    with torch.inference_mode():
        for run in runs.values():  # warm-up
            run(), sync()
        for _ in range(args.repeats):
            for name, run in runs.items():
                start = time.perf_counter()
                run()
                sync()
                times[name].append(time.perf_counter() - start)
    ms = {name: round(statistics.median(t) * 1e3, 2) for name, t in times.items()}
    print(
        json.dumps(
            {
                "model": f"hidden {cfg.hidden_size}, {cfg.num_layers} layers",
                "precision": args.precision,
                "device": str(device),
                "threads": args.threads,
                "prompts": args.prompts,
                "tokens": sum(s.prompt_len for s in seqs),
                "median_ms": ms,
                "speedup": round(ms["one_per_call"] / ms["batched"], 2),
            }
        )
    )


if __name__ == "__main__":
    main()
