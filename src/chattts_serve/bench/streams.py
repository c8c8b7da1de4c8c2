"""``chattts-serve bench streams``: N concurrent streaming requests inside one process (``AsyncEngine``,
the server's engine without HTTP), swept over N. Per level: time to first audio chunk (p50/p99),
per-stream real-time factor, underruns (a listener who starts at the first chunk would have to wait),
aggregate audio-seconds per wall-second. ``--reference-python``: the reference runs each level as one
batched ``Chat.infer`` and once with ``stream=True`` (its first chunk), in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from . import stats
from .common import add_model_arguments, engine_config, peak_memory_mb, run_reference, run_tool, set_threads, texts
from .serve_load import simulate_playback


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--concurrency", default="1,4,8,16,32", help="comma-separated stream counts")
    p.add_argument(
        "--stagger-ms",
        type=float,
        default=0.0,
        help="stream i starts i * this after the first (arrivals spread out as server traffic is, "
        "instead of one burst); time to first chunk counts from each stream's own start",
    )
    p.add_argument(
        "--unseeded", action="store_true", help="no seed per stream (as most server requests): random sampling"
    )


async def _level(engine, items: list[str], steps: int, stagger_s: float = 0.0, seeded: bool = True) -> dict[str, Any]:
    from ..sampling_params import SamplingParams

    async def one(i: int, text: str):
        seed = 100 + i if seeded else None
        params = SamplingParams(seed=seed, min_new_tokens=steps, max_new_tokens=steps, refine_text=False)
        if stagger_s:
            await asyncio.sleep(i * stagger_s)
        arrivals, audio, t0 = [], 0.0, time.perf_counter()
        async for chunk in engine.stream(text, params):
            audio += len(chunk.audio) / chunk.sample_rate
            arrivals.append((chunk.elapsed_s, audio))
        return arrivals, time.perf_counter() - t0

    t0 = time.perf_counter()
    res = await asyncio.gather(*(one(i, t) for i, t in enumerate(items)))
    wall = round(time.perf_counter() - t0, 4)  # rounded once: the rates below derive from it
    ttfb = [next(t for t, a in arr if a > 0) for arr, _ in res]
    audio = [arr[-1][1] for arr, _ in res]
    rtf = [total / a for (_, total), a in zip(res, audio, strict=True)]
    after_first = [(total - f) / a for (_, total), f, a in zip(res, ttfb, audio, strict=True)]
    plays = [simulate_playback(arr) for arr, _ in res]
    r3 = lambda d: {k: (round(v, 4) if isinstance(v, float) else v) for k, v in d.items()}  # noqa: E731
    return {
        "n": len(items),
        "stagger_ms": round(stagger_s * 1000, 3),
        "seeded": seeded,
        "wall_s": wall,
        "audio_s_per_s": round(sum(audio) / wall, 4),
        "ttfb_s": r3(stats.summarize(ttfb)),
        "rtf": r3(stats.summarize(rtf)),
        "rtf_after_first_chunk": r3(stats.summarize(after_first)),
        "underrun_streams": sum(not p.kept_up for p in plays),
        "stall_s_max": round(max(p.stall_s for p in plays), 3),
        "all_faster_than_real_time": max(rtf) < 1.0,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from ..engine.async_engine import AsyncEngine

    set_threads(args)
    levels = [int(x) for x in str(args.concurrency).split(",")]
    if min(levels) < 1 or args.steps < 1 or args.stagger_ms < 0:
        raise ValueError("--concurrency levels and --steps must be >= 1, --stagger-ms >= 0")
    if args.reference_python and (args.stagger_ms or args.unseeded):
        raise ValueError("--stagger-ms and --unseeded have no reference counterpart (its driver runs one batch)")
    config = engine_config(args, max_num_seqs=max(levels), max_model_len=args.steps + 256)
    engine = AsyncEngine.from_pretrained(args.model, args.device, config)
    try:
        asyncio.run(_level(engine, texts(args, 1), 8))  # warm-up
        stagger, seeded = args.stagger_ms / 1000, not args.unseeded
        ours = [asyncio.run(_level(engine, texts(args, n), args.steps, stagger, seeded)) for n in levels]
        device = engine.device
        decode = engine.decode_mode
    finally:
        engine.shutdown()
    out: dict[str, Any] = {
        "bench": "streams",
        "model": str(args.model),
        "device": str(device),
        "precision": args.precision,
        "kv_cache_dtype": args.kv_cache_dtype,
        "audio_dtype": args.audio_dtype,
        "decode": decode,
        "threads": torch.get_num_threads(),
        "steps": args.steps,
        "levels": ours,
        **peak_memory_mb(device),
    }
    if args.reference_python:
        py, th = args.reference_python, args.threads
        stream = run_reference(py, "stream", args.model, texts(args, 1), args.steps, th)
        ref = []
        for n in levels:
            r = run_reference(py, "offline", args.model, texts(args, n), args.steps, th)
            ref.append({"n": n, "wall_s": round(r["wall_s"], 3), "audio_s_per_s": round(r["audio_s"] / r["wall_s"], 4)})
        out["reference"] = {"first_chunk_s": round(stream["first_chunk_s"], 3), "levels": ref}
        out["throughput_ratio"] = {
            str(o["n"]): round(o["audio_s_per_s"] / r["audio_s_per_s"], 3) for o, r in zip(ours, ref, strict=True)
        }
        out["first_chunk_ratio"] = round(stream["first_chunk_s"] / ours[0]["ttfb_s"]["p50"], 2)
    return out


def plot(result: dict[str, Any], path: str) -> bool:
    x = [lv["n"] for lv in result["levels"]]
    thr = {"ours": [lv["audio_s_per_s"] for lv in result["levels"]]}
    if "reference" in result:
        thr["reference"] = [lv["audio_s_per_s"] for lv in result["reference"]["levels"]]
    ttfb = {
        "p50": [lv["ttfb_s"]["p50"] for lv in result["levels"]],
        "p99": [lv["ttfb_s"]["p99"] for lv in result["levels"]],
    }
    rtf = {"max": [lv["rtf"]["max"] for lv in result["levels"]], "real time": [1.0] * len(x)}
    stats.save_plot(
        path,
        x,
        [
            stats.Panel("audio-s per s", thr),
            stats.Panel("first chunk (s)", ttfb),
            stats.Panel("per-stream RTF", rtf),
        ],
        xlabel="concurrent streams",
        title=f"streams: {result['steps']} steps each, {result['precision']}, {result['device']}",
        logx=True,
    )
    return True


def main(args: argparse.Namespace) -> int:
    return run_tool(args, run, plot)
