"""``chattts-serve bench offline``: N texts through ``Engine.synthesize`` (continuous batching), the
throughput test. Reports wall time, audio-seconds per wall-second, texts per second (QPS), latency per
text (from the call to that text's completion: mean / p50 / p99), decode steps per second and peak
memory; with ``--reference-python`` the reference synthesises the same texts as one batched
``Chat.infer`` in the same run, and the ratios are printed. One JSON line; ``--plot`` a latency chart.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from ..engine.config import add_max_num_seqs_argument
from . import stats
from .common import add_model_arguments, engine_config, peak_memory_mb, run_reference, run_tool, set_threads, texts


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--num-texts", type=int, default=None, help="default: 256 on CUDA, 16 on CPU")
    add_max_num_seqs_argument(p, default=None, shown="--num-texts, at most 256")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--mixed-lengths",
        action="store_true",
        help="text i gets its own length, spread evenly over --steps/4 .. --steps (sequences finish at "
        "different steps and the batch shrinks, as in real traffic); default: every text --steps tokens",
    )


def lengths(steps: int, n: int, mixed: bool) -> list[int]:
    """Audio tokens of each of ``n`` texts: all ``steps``, or spread evenly over ``steps/4 .. steps``
    (deterministic, so two runs compare)."""
    if not mixed or n == 1:
        return [steps] * n
    lo = max(1, steps // 4)
    return [lo + (steps - lo) * i // (n - 1) for i in range(n)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from ..engine.engine import Engine
    from ..sampling_params import SamplingParams

    set_threads(args)
    n = args.num_texts if args.num_texts is not None else (256 if str(args.device).startswith("cuda") else 16)
    slots = args.max_num_seqs if args.max_num_seqs is not None else min(n, 256)
    if n < 1 or args.steps < 1:
        raise ValueError("--num-texts and --steps must be >= 1")
    if args.mixed_lengths and args.reference_python:
        raise ValueError("--mixed-lengths has no reference counterpart (its driver runs one length)")
    items = texts(args, n)
    config = engine_config(args, max_num_seqs=slots, max_model_len=args.steps + 256, max_waiting=max(1024, n))
    t_load = time.perf_counter()
    engine = Engine.from_pretrained(args.model, device=args.device, config=config)
    load_s = time.perf_counter() - t_load
    params = [
        SamplingParams(seed=args.seed, min_new_tokens=k, max_new_tokens=k, refine_text=False)
        for k in lengths(args.steps, n, args.mixed_lengths)
    ]
    engine.synthesize(items[:1], SamplingParams(seed=0, max_new_tokens=8, refine_text=False))  # warm-up
    if engine.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(engine.device)
        torch.cuda.synchronize(engine.device)
    t0 = time.perf_counter()
    results = engine.synthesize(items, params)
    # Round the measured figures once; every rate below derives from the reported values, so the
    # JSON is consistent with itself (audio_s_per_s == audio_s / wall_s up to the last digit).
    wall = round(time.perf_counter() - t0, 4)
    audio_s = round(sum(r.duration for r in results), 4)
    steps = sum(len(r.codes) for r in results)
    latency = [r.elapsed_s for r in results]
    out: dict[str, Any] = {
        "bench": "offline",
        "model": str(args.model),
        "device": str(engine.device),
        "precision": engine.precision.name,
        "kv_cache_dtype": args.kv_cache_dtype,
        "audio_dtype": args.audio_dtype,
        "decode": engine.decode_mode,
        "threads": torch.get_num_threads(),
        "num_texts": n,
        "max_num_seqs": slots,
        "steps": args.steps,
        "mixed_lengths": args.mixed_lengths,
        "load_s": round(load_s, 2),
        "wall_s": wall,
        "audio_s": audio_s,
        "audio_s_per_s": round(audio_s / wall, 4),
        "rtf": round(wall / audio_s, 4),
        "qps": round(n / wall, 4),
        "decode_steps_per_s": round(steps / wall, 2),
        "latency_s": {k: (round(v, 3) if isinstance(v, float) else v) for k, v in stats.summarize(latency).items()},
        **peak_memory_mb(engine.device),
    }
    if args.reference_python:
        ref = run_reference(args.reference_python, "offline", args.model, items, args.steps, args.threads)
        ref["audio_s_per_s"] = round(ref["audio_s"] / ref["wall_s"], 4)
        out["reference"] = ref
        out["speedup_vs_reference"] = round(out["audio_s_per_s"] / ref["audio_s_per_s"], 3)
    return out


def plot(result: dict[str, Any], latencies_path: str) -> bool:
    lat = result["latency_s"]
    x = [50, 90, 99]
    series = {"ours": [lat["p50"], lat["p90"], lat["p99"]]}
    if "reference" in result:  # one batched call: every text finishes at the end
        series["reference"] = [result["reference"]["wall_s"]] * 3
    stats.save_plot(
        latencies_path,
        x,
        [stats.Panel("latency (s)", series)],
        xlabel="percentile",
        title=f"offline: {result['num_texts']} texts x {result['steps']} steps, {result['precision']}",
    )
    return True


def main(args: argparse.Namespace) -> int:
    return run_tool(args, run, plot)
