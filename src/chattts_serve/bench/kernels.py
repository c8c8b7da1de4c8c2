"""The trunk's weight matmuls per library and kernel against the weight-read floor (``bench kernels``).

For each backend of ``trunk_backends`` (torch's fp32 / oneDNN / int8 / int4 kernels, the hand-written
4-bit GEMV ``cpp-int4-*`` (``kernels/int4_gemv``), ONNX Runtime's fp32, int8 and ``MatMulNBits`` at
each block size and accuracy level, OpenVINO's fp32, bf16 and nncf-compressed int8/int4) and each row
count (decode batch width): the time of a decode step's matmul
chain (every layer's projections and the output heads, ``trunk_backends._chain``) and of each op in it,
against the floor: the bytes of that backend's weights over the memory read bandwidth measured in the
same run (a sum over a buffer far larger than the caches). ``of_floor`` = floor / measured, 1.0 = at
the memory's rate. The shapes are the checkpoint's (``--model``), else the family's full-size preset.

The rounds interleave the backends (each round runs every backend once per row count, the bandwidth
measurement among them) and medians are reported, so a shared machine's noise lands on all alike: on
such a machine compare the ratios within one run. Torch backends' per-op times are timed calls (each
op over every layer's weights, so no op reads from a warm cache); ONNX Runtime's and OpenVINO's come
from their profilers (kernel time only, in a separate session), so they omit the call overhead that
the step's time includes.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default=None, help="checkpoint directory: its trunk's shapes (default: full-size ChatTTS)"
    )
    p.add_argument("--rows", default="1,4,32", help="comma-separated row counts (decode batch widths)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (medians are reported)")
    p.add_argument("--threads", type=int, default=1, help="threads of every library (torch, ORT, OpenVINO)")
    p.add_argument("--backends", default=None, help="comma-separated backend names (default: every one available)")
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the model's (a quick run)")
    p.add_argument("--profile-runs", type=int, default=3, help="steps under ORT's / OpenVINO's profiler, per row count")
    p.add_argument("--work-dir", default=None, help="where the ONNX graphs go (default: a temporary directory)")
    p.add_argument("--bandwidth-mb", type=int, default=1024, help="buffer of the read-bandwidth measurement")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--markdown", action="store_true", help="print the tables as markdown before the JSON line")


def trunk_shape(model: str | None, layers: int | None):
    from ..models.chattts.config import ModelConfig
    from .trunk_backends import TrunkShape

    if model:
        from ..models.chattts.checkpoint import read_config, resolve

        cfg = read_config(resolve(model)).gpt
    else:
        cfg = ModelConfig.full().gpt
    return TrunkShape(
        hidden=cfg.hidden_size,
        intermediate=cfg.intermediate_size,
        layers=layers or cfg.num_layers,
        qkv_out=(cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim,
        heads_out=cfg.num_vq * cfg.num_audio_tokens,
    )


def build(shape, names: set[str] | None, work: Path, seed: int, xs: dict) -> tuple[dict[str, Any], dict]:
    """Every available backend (or the named ones), built from one set of random weights, and the
    chain's float64 output for each input of ``xs`` (what ``rel_err`` compares with)."""

    from . import trunk_backends as tb

    weights = tb.random_weights(shape, seed)
    refs = {r: tb.reference_chain(shape, weights, x) for r, x in xs.items()}
    builders = dict(tb.torch_backends(shape, weights, names))
    graph_names = names is None or any(n.startswith(("ort-", "ov-")) for n in names)
    if graph_names:
        fp32_dir = work / "ort-fp32"
        onnx_path = tb.write_onnx_chain(shape, weights, fp32_dir)
        builders.update(tb.ort_backends(shape, fp32_dir, work, names))
        builders.update(tb.openvino_backends(onnx_path, names))
    backends: dict[str, Any] = {}
    for name, make in builders.items():
        try:
            backends[name] = make()
        except Exception as exc:  # a library that cannot run here is reported, not fatal
            backends[name] = exc
        gc.collect()
    if names:
        unknown = names - set(backends)
        if unknown:
            raise ValueError(f"unknown or unavailable backend(s): {', '.join(sorted(unknown))}")
    del weights
    return backends, refs


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from .trunk_backends import OPS, TorchBackend

    torch.set_num_threads(args.threads)
    shape = trunk_shape(args.model, args.layers)
    rows_list = [int(r) for r in args.rows.split(",")]
    names = set(args.backends.split(",")) if args.backends else None
    if args.work_dir:  # a directory named on the command line need not exist yet
        Path(args.work_dir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp:
        g = torch.Generator().manual_seed(args.seed)
        xs = {r: torch.randn(r, shape.hidden, generator=g) for r in rows_list}
        backends, refs = build(shape, names, Path(tmp), args.seed, xs)
        failed = {n: f"{type(b).__name__}: {b}" for n, b in backends.items() if isinstance(b, Exception)}
        ok = {n: b for n, b in backends.items() if not isinstance(b, Exception)}
        buf = torch.ones(args.bandwidth_mb << 18)  # fp32: MB * 2**20 / 4
        dst = torch.empty_like(buf)
        op_x = {r: {o: torch.randn(r, shape.op_shape(o)[1], generator=g) for o in OPS} for r in rows_list}
        step: dict[int, dict[str, list[float]]] = {r: {n: [] for n in ok} for r in rows_list}
        ops: dict[int, dict[str, dict[str, list[float]]]] = {
            r: {n: {o: [] for o in OPS} for n in ok} for r in rows_list
        }
        read_s, copy_s = [], []
        with torch.inference_mode():
            rel_err: dict[str, dict[int, float]] = {n: {} for n in ok}
            for r in rows_list:  # warm-up (first touches, lazy inits, per-shape kernels), and the error
                for n, b in ok.items():
                    y = b.output(xs[r]).double()
                    rel_err[n][r] = float((y - refs[r]).norm() / refs[r].norm())
            for _ in range(args.rounds):
                read_s.append(_timed(lambda: buf.sum().item()))
                copy_s.append(_timed(lambda: dst.copy_(buf)))
                for r in rows_list:
                    x = xs[r]
                    for n, b in ok.items():
                        step[r][n].append(_timed(lambda b=b, x=x: b.step(x)))
                        if isinstance(b, TorchBackend):
                            for o in OPS:
                                ops[r][n][o].append(
                                    _timed(lambda b=b, o=o, x=op_x[r][o]: _op_all_layers(shape, b, o, x))
                                )
            profiles = {}
            for r in rows_list:
                for n, b in ok.items():
                    try:
                        prof = b.op_profile(xs[r], args.profile_runs)
                    except Exception as exc:
                        prof = {"error": f"{type(exc).__name__}: {exc}"}
                    if prof is not None:
                        profiles[(r, n)] = prof
        nbytes = buf.numel() * 4
        read_gbs = nbytes / statistics.median(read_s) / 1e9
        results: dict[str, Any] = {
            "shape": {
                "hidden": shape.hidden,
                "intermediate": shape.intermediate,
                "layers": shape.layers,
                "qkv_out": shape.qkv_out,
                "heads_out": shape.heads_out,
                "params": shape.params(),
            },
            "threads": args.threads,
            "rounds": args.rounds,
            "read_gbs": round(read_gbs, 2),
            "copy_gbs": round(nbytes / statistics.median(copy_s) / 1e9, 2),
            "read_best_gbs": round(nbytes / min(read_s) / 1e9, 2),
            "floor_int4_ms": round(shape.params() / 2 / read_gbs / 1e6, 3),
            "backends": {},
            "failed": failed,
        }
        for n, b in ok.items():
            floor_ms = b.weight_bytes / read_gbs / 1e6
            entry: dict[str, Any] = {"weight_mb": round(b.weight_bytes / 1e6, 1), "floor_ms": round(floor_ms, 3)}
            if b.note:
                entry["note"] = b.note
            for r in rows_list:
                ms = 1000 * statistics.median(step[r][n])
                row: dict[str, Any] = {
                    "step_ms": round(ms, 3),
                    "of_floor": round(floor_ms / ms, 3),
                    "rel_err": round(rel_err[n][r], 5),
                }
                if isinstance(b, TorchBackend):
                    op_ms = {o: 1000 * statistics.median(ops[r][n][o]) for o in OPS}
                else:
                    op_ms = profiles.get((r, n), {})
                row["ops_ms"] = {o: (round(v, 3) if isinstance(v, float) else v) for o, v in op_ms.items()}
                row["ops_of_floor"] = {
                    o: round(floor_ms * shape.params(o) / shape.params() / op_ms[o], 3)
                    for o in OPS
                    if isinstance(op_ms.get(o), float) and op_ms[o] > 0
                }
                entry[f"rows_{r}"] = row
            results["backends"][n] = entry
    return results


def _op_all_layers(shape, backend, op: str, x) -> list:
    """One op over every layer's weights (distinct weights: none of them is still in a cache)."""
    return [backend.op(op, i, x) for i in range(shape.op_count(op))]


def markdown(result: dict[str, Any]) -> str:
    """The step table (backend x rows: ms and of_floor) and the per-op table (of the first row count
    and the last)."""
    rows = sorted(int(k[5:]) for k in next(iter(result["backends"].values())) if k.startswith("rows_"))
    lines = [
        f"read {result['read_gbs']} GB/s (best round {result['read_best_gbs']}), copy {result['copy_gbs']} GB/s "
        f"({result['threads']} thread(s)); "
        f"4-bit floor of the step {result['floor_int4_ms']} ms; medians of {result['rounds']} rounds",
        "",
        "| backend | weights MB | floor ms | rel. error | "
        + " | ".join(f"{r} row(s): ms (of floor)" for r in rows)
        + " |",
        "| --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in rows) + " |",
    ]
    for n, e in result["backends"].items():
        cells = [f"{e[f'rows_{r}']['step_ms']} ({e[f'rows_{r}']['of_floor']})" for r in rows]
        err = e[f"rows_{rows[-1]}"]["rel_err"]
        lines.append(f"| {n} | {e['weight_mb']} | {e['floor_ms']} | {err} | " + " | ".join(cells) + " |")
    from .trunk_backends import OPS

    for r in (rows[0], rows[-1]) if len(rows) > 1 else rows:
        lines += ["", f"per op, {r} row(s): ms per step (of floor)", ""]
        lines.append("| backend | " + " | ".join(OPS) + " |")
        lines.append("| --- | " + " | ".join("---:" for _ in OPS) + " |")
        for n, e in result["backends"].items():
            row = e[f"rows_{r}"]
            cells = [
                f"{row['ops_ms'][o]} ({row['ops_of_floor'].get(o, '-')})"
                if isinstance(row["ops_ms"].get(o), float)
                else "-"
                for o in OPS
            ]
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
    if result["failed"]:
        lines += ["", "not run: " + "; ".join(f"{n} ({why})" for n, why in result["failed"].items())]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    from .common import run_tool

    return run_tool(args, measure, markdown=markdown)
