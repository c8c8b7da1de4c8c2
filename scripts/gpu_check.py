"""The one GPU check: correctness, then the numbers, on a CUDA machine in under 8 minutes.

    python scripts/gpu_check.py --out gpu_results.jsonl          # writes a full-size random checkpoint first
    python scripts/gpu_check.py --model DIR --out results.jsonl  # or uses yours

1. CUDA graphs: every captured graph passes its start-up self-check (replay vs an eager step), and
   the graph decode step gives the same codes as the same step run eagerly; replays vs eager steps
   are counted.
2. Precision: bf16 / fp16 / int8 against fp32 on the GPU (``chattts-serve eval``: teacher-forced code
   agreement and KL, free-run agreement, mel distance, waveform SNR).
3. Offline throughput: 256 texts of ~10 s (``bench offline``), fp32 and bf16.
4. Streaming: single-stream time to first chunk and a concurrency sweep (``bench streams``), bf16.
5. Audio decode overlap: the same concurrent streams with the audio decode on its own CUDA stream
   (collected a step later) and inside the step; wall times, same codes.

Every result is one JSON line, printed and appended to ``--out``; the last line is a summary with
pass/fail. ``--device cpu --quick`` runs the same code on a CPU with tiny sizes (the test suite does,
so the script cannot rot between GPU sessions). Copy what it prints into BENCHMARKS.md with the date,
the GPU and the commit.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from chattts_serve.bench import eval as eval_tool
from chattts_serve.bench import offline, streams
from chattts_serve.engine.config import EngineConfig, RunnerConfig
from chattts_serve.engine.engine import Engine
from chattts_serve.model.random_checkpoint import write_random
from chattts_serve.sampling_params import SamplingParams


def _ns(module, argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    module.add_arguments(p)
    return p.parse_args(argv)


def _commit() -> str:
    try:
        root = Path(__file__).resolve().parents[1]
        return subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def check_graphs(model: str, device: str, steps: int) -> dict:
    """Graph replay vs eager, same static step, same buckets: the codes must be identical."""
    texts = ["今天天气真不错，我们一起去公园散步吧。", "The quick brown fox jumps over the lazy dog."] * 2
    params = SamplingParams(seed=11, min_new_tokens=steps, max_new_tokens=steps, refine_text=False)
    runs = {}
    for graphs in (False, True):
        eng = Engine.from_pretrained(
            model, device, EngineConfig.with_slots(4, runner=RunnerConfig(decode="static", cuda_graphs=graphs))
        )
        n_graphs = len(eng.core.runner.static.graphs)
        t0 = time.perf_counter()
        res = eng.synthesize(texts, params)
        runs[graphs] = (res, time.perf_counter() - t0, n_graphs, eng.core.stats())
        del eng
    same = all(np.array_equal(a.codes, b.codes) for a, b in zip(runs[False][0], runs[True][0], strict=True))
    wav = max(float(np.abs(a.audio - b.audio).max()) for a, b in zip(runs[False][0], runs[True][0], strict=True))
    stats = runs[True][3]
    on_gpu = device != "cpu"
    second = _second_device(model, device, texts, params, runs[True][0]) if on_gpu else {}
    return {
        "check": "cuda_graph_vs_eager",
        "codes_identical": same,
        "max_abs_wav_diff": wav,
        "graphs_captured": runs[True][2],
        "graphs_refused": stats.graphs_refused,  # failed the self-check: replay != eager step
        "graph_replays": stats.graph_replays,
        "eager_fallbacks": stats.eager_steps,
        "eager_wall_s": round(runs[False][1], 3),
        "graph_wall_s": round(runs[True][1], 3),
        **second,
        "passed": same
        and stats.graphs_refused == 0
        and second.get("second_device_passed", True)
        and (not on_gpu or (runs[True][2] > 0 and stats.graph_replays > 0)),
    }


def _second_device(model: str, device: str, texts: list[str], params: SamplingParams, want: list) -> dict:
    """The same graph step on another card (the first device's graphs were recorded with it current;
    this one's must be recorded on its own): every graph passes its self-check, the codes match."""
    if torch.cuda.device_count() < 2:
        return {"second_device": None}
    other = "cuda:1" if torch.device(device).index in (None, 0) else "cuda:0"
    eng = Engine.from_pretrained(model, other, EngineConfig.with_slots(4, runner=RunnerConfig(decode="static")))
    got = eng.synthesize(texts, params)
    stats = eng.core.stats()
    same = all(np.array_equal(a.codes, b.codes) for a, b in zip(want, got, strict=True))
    return {
        "second_device": other,
        "second_device_graphs": len(eng.core.runner.static.graphs),
        "second_device_graphs_refused": stats.graphs_refused,
        "second_device_graph_replays": stats.graph_replays,
        "second_device_codes_identical": same,
        "second_device_passed": same and stats.graphs_refused == 0 and stats.graph_replays > 0,
    }


def check_audio_overlap(model: str, device: str, precision: str, n_streams: int, steps: int) -> dict:
    """Streams decoded with the audio on its own stream (overlapping the next GPT step) and inline,
    on one engine (only its audio decoder is swapped): wall time of each, and the same codes."""
    from chattts_serve.audio.overlap import AudioDecoder
    from chattts_serve.audio.policy import StreamPolicy

    texts = ["今天天气真不错，我们一起去公园散步吧。", "The quick brown fox jumps over the lazy dog."]
    config = EngineConfig.with_slots(n_streams, precision=precision)
    eng = Engine.from_pretrained(model, device, config)
    core = eng.core
    params = SamplingParams(seed=7, min_new_tokens=steps, max_new_tokens=steps, refine_text=False)
    runs = {}
    for overlap in (False, True, False, True):  # the first pair warms up (shapes, allocator)
        core.audio = AudioDecoder(core.model, core.device, core.audio_dtype, overlap=overlap, buckets=True)
        for i in range(n_streams):
            core.add_request(f"s{i}", core.prepare(texts[i % 2], params), StreamPolicy())
        codes: dict[str, list] = {}
        t0 = time.perf_counter()
        while core.has_unfinished():
            for out in core.step():
                if out.finished:
                    codes[out.request_id] = [seg.codes for seg in out.segments]
        runs[overlap] = (time.perf_counter() - t0, codes)
    same = all(
        all(np.array_equal(a, b) for a, b in zip(runs[True][1][rid], runs[False][1][rid], strict=True))
        for rid in runs[False][1]
    )
    inline_s, overlap_s = runs[False][0], runs[True][0]
    return {
        "check": "audio_overlap",
        "streams": n_streams,
        "steps": steps,
        "audio_dtype": core.audio_dtype,
        "inline_wall_s": round(inline_s, 3),
        "overlap_wall_s": round(overlap_s, 3),
        "speedup": round(inline_s / overlap_s, 3) if overlap_s > 0 else None,
        "codes_identical": same,
        "passed": same and len(runs[True][1]) == n_streams,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="checkpoint dir (default: write a full-size random one)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default="gpu_results.jsonl")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (CPU self-test of this script)")
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_check: no CUDA device", file=sys.stderr)
        return 2
    quick = args.quick
    model = args.model
    if model is None:
        model = str(write_random(Path(tempfile.mkdtemp()) / "ckpt", "tiny" if quick else "full", seed=0))
    out = Path(args.out)
    t_start = time.perf_counter()
    results: list[dict] = []

    def record(r: dict) -> None:
        r = {**r, "elapsed_s": round(time.perf_counter() - t_start, 1)}
        results.append(r)
        line = json.dumps(r, ensure_ascii=False, default=str)
        print(line, flush=True)
        with out.open("a", encoding="utf-8") as f:
            f.write(line + "\n")

    gpu = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    record({"check": "environment", "device": gpu, "torch": torch.__version__, "commit": _commit(), "model": model})

    record(check_graphs(model, args.device, 16 if quick else 200))

    modes = "int8-static" if args.device == "cpu" else "bf16,fp16,int8"
    ev = eval_tool.run(
        _ns(
            eval_tool,
            [
                "--model",
                model,
                "--device",
                args.device,
                "--modes",
                modes,
                "--steps",
                "16" if quick else "200",
                "--num-texts",
                "2" if quick else "4",
            ],
        )
    )
    ok = all(m["tf_top1_agreement"] >= (0.0 if quick else 0.9) for m in ev["modes"])
    record({"check": "precision_vs_fp32", "modes": ev["modes"], "passed": ok})

    n_texts, steps = ("4", "12") if quick else ("256", "469")
    for precision in ("fp32", "bf16") if not quick else ("fp32",):
        r = offline.run(
            _ns(
                offline,
                [
                    "--model",
                    model,
                    "--device",
                    args.device,
                    "--precision",
                    precision,
                    "--num-texts",
                    n_texts,
                    "--steps",
                    steps,
                ],
            )
        )
        record(
            {
                "check": "offline",
                **{
                    k: r[k]
                    for k in (
                        "precision",
                        "num_texts",
                        "steps",
                        "wall_s",
                        "audio_s_per_s",
                        "rtf",
                        "qps",
                        "decode_steps_per_s",
                        "latency_s",
                        "load_s",
                    )
                    if k in r
                },
                **{k: v for k, v in r.items() if k.startswith("peak_")},
            }
        )

    levels = "1,2" if quick else "1,4,16,64,256"
    r = streams.run(
        _ns(
            streams,
            [
                "--model",
                model,
                "--device",
                args.device,
                "--precision",
                "fp32" if quick else "bf16",
                "--concurrency",
                levels,
                "--steps",
                "12" if quick else "469",
            ],
        )
    )
    record({"check": "streams", "precision": r["precision"], "levels": r["levels"]})

    n_streams, overlap_steps = (2, 12) if quick else (64, 200)
    record(check_audio_overlap(model, args.device, "fp32" if quick else "bf16", n_streams, overlap_steps))

    passed = all(r.get("passed", True) for r in results)
    record({"check": "summary", "passed": passed, "total_s": round(time.perf_counter() - t_start, 1)})
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
