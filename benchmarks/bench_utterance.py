"""Wall time of one fixed-length utterance (default 469 steps = 10.0 s of audio), ours and optionally
the reference in the same run, on the same checkpoint.

    python benchmarks/bench_utterance.py --ckpt ./ckpt-full [--reference-python REF/bin/python]

Prints one JSON line: medians of wall time, real-time factor, decode steps/s, and the ratio to the
reference. Run it on a quiet machine (another busy process on these 2 cores skews it several-fold).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time

import torch
from common import full_checkpoint, run_reference

from chattts_serve import Engine, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", default="checkpoints/full", help="written with write_random(size=full) if missing")
    ap.add_argument("--tokens", type=int, default=469)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--reference-python", default=None)
    args = ap.parse_args()
    ckpt = full_checkpoint(args.ckpt)
    torch.set_num_threads(args.threads)
    engine = Engine.from_pretrained(ckpt, dtype=args.dtype)
    params = SamplingParams(seed=1, min_new_tokens=args.tokens, max_new_tokens=args.tokens, refine_text=False)
    text = "今天天气真不错，我们一起去公园散步吧。"
    walls = []
    for _ in range(args.repeats + 1):
        t0 = time.perf_counter()
        [r] = engine.synthesize(text, params)
        walls.append(time.perf_counter() - t0)
    ours = statistics.median(walls[1:])
    audio_s = args.tokens * 512 / 24000
    out = {
        "bench": "utterance",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.processor() or platform.machine(),
        "threads": args.threads,
        "dtype": args.dtype,
        "tokens": args.tokens,
        "audio_s": round(audio_s, 3),
        "wall_s": round(ours, 3),
        "rtf": round(ours / audio_s, 3),
        "steps_per_s": round(args.tokens / ours, 2),
        "runs": [round(w, 3) for w in walls[1:]],
    }
    if args.reference_python:
        ref = run_reference(
            args.reference_python,
            "reference_utterance.py",
            str(ckpt),
            "--tokens",
            str(args.tokens),
            "--repeats",
            str(args.repeats),
            "--threads",
            str(args.threads),
            timeout=3600,
        )
        ref_wall = statistics.median(ref["wall_s"])
        out.update(
            reference_wall_s=round(ref_wall, 3),
            reference_rtf=round(ref_wall / audio_s, 3),
            reference_steps_per_s=round(args.tokens / ref_wall, 2),
            speedup=round(ref_wall / ours, 3),
        )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
