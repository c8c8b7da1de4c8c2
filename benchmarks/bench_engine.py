"""Engine throughput and latency on CPU (or GPU), with the reference measured in the same run.

    python benchmarks/bench_engine.py --ckpt checkpoints/full --concurrency 1,4,8,16,32 \
        --steps 150 [--reference-python .venv-reference/bin/python]

For each concurrency N: N streams start together (AsyncEngine, default streaming policy), each with a
fixed length (min = max = --steps). Reports per N: wall time, aggregate audio-seconds per wall-second,
time to first audio chunk (median / max over streams), per-stream real-time factor. Single-stream decode
steps/s comes from N = 1. The reference runs the same texts as one batched ``infer`` call per N
(its only form of concurrency) and, for N = 1, ``stream=True`` for its first chunk. One JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import statistics
import time

import torch
from common import full_checkpoint, run_reference

from chattts_serve import SamplingParams
from chattts_serve.engine.async_engine import AsyncEngine
from chattts_serve.engine.scheduler import SchedulerConfig

TEXT = "今天天气真不错，我们一起去公园散步吧。"
SAMPLES_PER_STEP = 512
RATE = 24000


async def run_concurrency(engine: AsyncEngine, n: int, steps: int) -> dict:
    async def one(i: int):
        first, t0 = None, time.monotonic()
        total = 0
        async for chunk in engine.stream(
            TEXT, SamplingParams(seed=100 + i, min_new_tokens=steps, max_new_tokens=steps, refine_text=False)
        ):
            if first is None and len(chunk.audio):
                first = chunk.elapsed_s
            total += len(chunk.audio)
        return first, time.monotonic() - t0, total

    t0 = time.monotonic()
    res = await asyncio.gather(*(one(i) for i in range(n)))
    wall = time.monotonic() - t0
    audio_s = sum(r[2] for r in res) / RATE
    ttfb = [r[0] for r in res]
    per_stream_rtf = [r[1] / (r[2] / RATE) for r in res]
    return {
        "n": n,
        "wall_s": round(wall, 3),
        "audio_s_per_s": round(audio_s / wall, 3),
        "ttfb_median_s": round(statistics.median(ttfb), 3),
        "ttfb_max_s": round(max(ttfb), 3),
        "rtf_max": round(max(per_stream_rtf), 3),
        "steps_per_s_per_stream": round(steps / max(r[1] for r in res), 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", default="checkpoints/full")
    ap.add_argument("--concurrency", default="1,4,8,16,32")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--reference-python", default=None)
    args = ap.parse_args()
    ckpt = full_checkpoint(args.ckpt)
    torch.set_num_threads(args.threads)
    levels = [int(x) for x in args.concurrency.split(",")]
    sched = SchedulerConfig(max_num_seqs=max(levels), max_model_len=args.steps + 128)
    engine = AsyncEngine.from_pretrained(ckpt, device=args.device, dtype=args.dtype, scheduler=sched)
    asyncio.run(run_concurrency(engine, 1, 8))  # warm-up
    ours = [asyncio.run(run_concurrency(engine, n, args.steps)) for n in levels]
    engine.shutdown()
    out = {
        "bench": "engine",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": args.device,
        "threads": args.threads,
        "dtype": args.dtype,
        "steps": args.steps,
        "ours": ours,
    }
    if args.reference_python:
        ref = run_reference(
            args.reference_python,
            "reference_engine.py",
            str(ckpt),
            "--steps",
            str(args.steps),
            "--concurrency",
            args.concurrency,
            "--threads",
            str(args.threads),
            timeout=7200,
        )
        out["reference"] = ref
        out["ratios"] = {
            str(o["n"]): round(o["audio_s_per_s"] / r["audio_s_per_s"], 2)
            for o, r in zip(ours, ref["levels"], strict=True)
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
