"""What the first-sentence voice step costs a stream: time to first audio and total time of a split
text, with the step on and off, one stream at a time, medians of --repeats runs (same run, same machine).

    python scripts/bench_voice_step.py --model CKPT [--precision int8-static] [--steps 60] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import subprocess

import torch

from chattts_serve import SamplingParams
from chattts_serve.engine.async_engine import AsyncEngine
from chattts_serve.engine.config import EngineConfig

TEXT = "今天天气真不错。我们一起去公园散步吧。你觉得怎么样。"


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except Exception:
        return platform.processor()


async def one(engine: AsyncEngine, params: SamplingParams) -> tuple[float, float]:
    first = None
    async for chunk in engine.stream(TEXT, params):
        if first is None and len(chunk.audio):
            first = chunk.elapsed_s
        last = chunk.elapsed_s
    return first, last


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = AsyncEngine.from_pretrained(args.model, config=EngineConfig.with_slots(4, precision=args.precision))
    speaker = engine.sample_speaker(seed=1)
    base = dict(seed=7, speaker=speaker, refine_text=False, min_new_tokens=args.steps, max_new_tokens=args.steps)
    out = {"cpu": cpu_name(), "precision": args.precision, "threads": args.threads, "steps_per_sentence": args.steps}
    try:
        asyncio.run(one(engine, SamplingParams(**{**base, "max_new_tokens": 8, "min_new_tokens": 8})))  # warm-up
        for name, on in (("voice_step", True), ("no_voice_step", False)):
            runs = [
                asyncio.run(one(engine, SamplingParams(**base, first_sentence_voice=on))) for _ in range(args.repeats)
            ]
            out[name] = {
                "first_audio_s": round(statistics.median(r[0] for r in runs), 3),
                "total_s": round(statistics.median(r[1] for r in runs), 3),
            }
    finally:
        engine.shutdown()
    out["first_audio_ratio"] = round(out["voice_step"]["first_audio_s"] / out["no_voice_step"]["first_audio_s"], 2)
    out["total_ratio"] = round(out["voice_step"]["total_s"] / out["no_voice_step"]["total_s"], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
