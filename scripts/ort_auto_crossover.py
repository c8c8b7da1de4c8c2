"""Where ``ort-auto`` should switch from the 4-bit to the int8 trunk on this CPU: one decode step of
each session at several row counts, the two calls alternating (drift on a shared box hits both),
medians. Prints one JSON line: per width the two medians, and the smallest width from which int8 is
ahead at every width measured, to put in ``models.chattts.onnx_auto.CROSSOVER_TABLE`` under this CPU's kind
(or pass as ``--ort-auto-crossover``).

    python scripts/ort_auto_crossover.py --model CKPT [--widths 1,2,3,4,6,8,16,32] [--pairs 21] [--context 100]

Run it on a quiet machine with the full-size checkpoint (a random one does: only the shapes matter).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from chattts_serve.cpu import probe
from chattts_serve.models.chattts import checkpoint
from chattts_serve.models.chattts.onnx_export import cached_export
from chattts_serve.models.chattts.onnx_trunk import OnnxTrunk


def step_medians(trunks: dict[str, OnnxTrunk], width: int, context: int, pairs: int) -> dict[str, float]:
    """Median seconds of one decode step of ``width`` rows at ``context`` cached positions, per session."""
    cfg = next(iter(trunks.values())).cfg
    gen = torch.Generator().manual_seed(width)
    cache = trunks["int4"].new_cache(width, context + 1)
    cache.k.normal_(generator=gen), cache.v.normal_(generator=gen)
    x = torch.randn(width, 1, cfg.hidden_size, generator=gen)
    seqlens, one = np.full(width, context, np.int32), np.ones(width, np.int32)
    times: dict[str, list[float]] = {name: [] for name in trunks}
    for trunk in trunks.values():  # warm-up: first runs allocate
        trunk.run(x, cache, 0, seqlens, one)
    for _ in range(pairs):
        for name, trunk in trunks.items():
            start = time.perf_counter()
            trunk.run(x, cache, 0, seqlens, one)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def crossover(rows: dict[int, dict[str, float]]) -> int:
    """The smallest width from which int8 is at least as fast at every measured width (past the last: 1
    more than the widest, i.e. never switch)."""
    widths = sorted(rows)
    for i, w in enumerate(widths):
        if all(rows[v]["int8"] <= rows[v]["int4"] for v in widths[i:]):
            return w
    return widths[-1] + 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--widths", default="1,2,3,4,6,8,16,32")
    p.add_argument("--pairs", type=int, default=21, help="alternating int4/int8 calls per width")
    p.add_argument("--context", type=int, default=100, help="cached positions per row")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--onnx-cache-dir", default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = checkpoint.load(args.model)
    cfg = model.config.gpt
    dirs = {w: cached_export(model, w, args.onnx_cache_dir) for w in ("int4", "int8")}
    del model
    trunks = {w: OnnxTrunk(d, cfg, w, torch.device("cpu")) for w, d in dirs.items()}
    widths = sorted({int(w) for w in args.widths.split(",")})
    rows = {w: step_medians(trunks, w, args.context, args.pairs) for w in widths}
    print(
        json.dumps(
            {
                "cpu_kind": probe().kind,
                "cpu": probe().describe(),
                "threads": torch.get_num_threads(),
                "context": args.context,
                "ms": {w: {k: round(1000 * v, 2) for k, v in r.items()} for w, r in rows.items()},
                "crossover": crossover(rows),
            }
        )
    )


if __name__ == "__main__":
    main()
