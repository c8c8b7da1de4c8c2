"""The audio stage (Decoder + Vocos) per window, per runtime (``bench audio``): torch fp32 (the
reference-exact path), torch bf16 (autocast, ``--audio-dtype bf16``), and the same convolutions as one
graph in ONNX Runtime (fp32) and OpenVINO (fp32, bf16) (``audio.cpu_graph``). Each: ms per window batch,
times real time (seconds of audio decoded per second, on the threads given), and the waveform's SNR
against torch fp32 on the same hidden states (random, of the trunk's scale: the quality cost of the
runtime's arithmetic alone). Interleaved rounds, medians: compare the ratios within one run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from .stats import snr_db as _snr_db


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--windows", default="1x150,8x150,1x48", help="comma-separated ROWSxSTEPS window batches")
    p.add_argument(
        "--runtimes", default=None, help="comma-separated (default: torch-fp32, torch-bf16 and every graph one)"
    )
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--markdown", action="store_true", help="print a markdown table before the JSON line")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from ..audio.cpu_graph import RUNTIMES, AudioGraph
    from ..audio.decode import _decode_batch
    from ..models.chattts.checkpoint import load

    torch.set_num_threads(args.threads)
    model = load(args.model)
    names = args.runtimes.split(",") if args.runtimes else ["torch-fp32", "torch-bf16", *RUNTIMES]
    paths: dict[str, Any] = {}
    failed: dict[str, str] = {}
    for n in names:
        if n in ("torch-fp32", "torch-bf16"):
            paths[n] = lambda h, d=n[6:]: _decode_batch(model, h, d, None)
            continue
        try:
            paths[n] = AudioGraph(model, n, args.threads).decode
        except Exception as exc:  # a runtime that is missing or cannot take the graph is reported
            failed[n] = f"{type(exc).__name__}: {exc}"[:300]
    windows = [tuple(int(v) for v in w.split("x")) for w in args.windows.split(",")]
    g = torch.Generator().manual_seed(args.seed)
    hidden = model.config.gpt.hidden_size
    hs = {w: torch.randn(w[0], w[1], hidden, generator=g) for w in windows}
    times: dict[tuple, dict[str, list[float]]] = {w: {n: [] for n in paths} for w in windows}
    snr: dict[tuple, dict[str, float]] = {w: {} for w in windows}
    with torch.inference_mode():
        for w in windows:
            ref = paths["torch-fp32"](hs[w]) if "torch-fp32" in paths else None
            for n, fn in paths.items():
                out = fn(hs[w])  # warm-up, and the quality figure
                if ref is not None:
                    snr[w][n] = round(_snr_db(ref.double(), out.double()), 2)
        for _ in range(args.rounds):
            for w in windows:
                for n, fn in paths.items():
                    t0 = time.perf_counter()
                    fn(hs[w])
                    times[w][n].append(time.perf_counter() - t0)
    result: dict[str, Any] = {"threads": args.threads, "rounds": args.rounds, "windows": [], "failed": failed}
    for w in windows:
        audio_s = w[0] * (512 * w[1] - 256) / 24000
        entry = {"rows": w[0], "steps": w[1], "audio_s": round(audio_s, 3), "runtimes": {}}
        for n in paths:
            ms = 1000 * statistics.median(times[w][n])
            entry["runtimes"][n] = {
                "ms": round(ms, 2),
                "x_realtime": round(audio_s * 1000 / ms, 1),
                "snr_db": snr[w].get(n),
            }
        result["windows"].append(entry)
    return result


def markdown(result: dict[str, Any]) -> str:
    names = list(result["windows"][0]["runtimes"])
    lines = [
        f"{result['threads']} thread(s), medians of {result['rounds']} rounds; ms per window batch, x real time, "
        "SNR vs torch fp32 (dB)",
        "",
        "| window (rows x steps) | " + " | ".join(names) + " |",
        "| --- | " + " | ".join("---:" for _ in names) + " |",
    ]
    for w in result["windows"]:
        cells = [
            f"{r['ms']} ms, {r['x_realtime']}x, {r['snr_db'] if r['snr_db'] is not None else '-'} dB"
            for r in w["runtimes"].values()
        ]
        lines.append(f"| {w['rows']} x {w['steps']} | " + " | ".join(cells) + " |")
    if result["failed"]:
        lines += ["", "not run: " + "; ".join(f"{n} ({why})" for n, why in result["failed"].items())]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    from .common import run_tool

    return run_tool(args, measure, markdown=markdown)
