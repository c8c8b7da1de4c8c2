"""Decode attention against the memory it must read (``chattts-serve bench attention``).

One decode step's attention on the full-size model's shapes (every layer, a cache of its own per layer,
caches filled: see BENCHMARKS.md on untouched pages): each row in its own slot, slots gathered out of
order, ragged lengths drawn from ``--min-len``..``--max-len``. Timed back to back in each round, the
CPU caches flushed before each call; medians over the rounds, all in one run (the ratios are what to
compare on a shared machine):

- ``read``: streaming the step's bf16 keys and values once (a sum over a buffer of that size), the
  floor; ``copy``: a copy of that buffer (bytes copied per second);
- ``kernel``: ``kernels.decode_attention`` on the bf16 cache (GB/s of keys and values, and the floor
  over its time: 1.0 = at the read bandwidth);
- ``read-int8``: the same read of the int8 cache's bytes (int8 vectors and their fp32 scales: 68 bytes a
  vector at head_dim 64, 0.53 of bf16's), its floor; ``kernel-int8``: the op on the int8 cache made of the
  same values (``kernels.kv_int8``), reported as its floor over its time and its speed-up over ``kernel``;
  ``torch-int8``: the int8 cache's torch fallback (each row dequantized to fp32; ``--no-fp32`` skips it too);
- ``torch-bf16``: today's path for a bf16 cache (torch's SDPA row by row, ``Attention._attend_rows``);
- ``torch-fp32``: the same on an fp32 cache of the same values (the fp32 mode's path; twice the bytes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

FLUSH_BYTES = 256 << 20
"""Read before each timed call: more than any CPU's last-level cache, so no call starts warm."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", default="1,8,32,64", help="comma-separated row counts (decode batch widths)")
    p.add_argument("--min-len", type=int, default=300, help="shortest row context (positions)")
    p.add_argument("--max-len", type=int, default=800, help="longest row context (positions)")
    p.add_argument("--layers", type=int, default=None, help="layers per step (default: the full model's)")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds (medians are reported)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--no-fp32", action="store_true", help="skip the fp32-cache comparison (saves its memory)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def _time(fn: Callable[[], Any], flush: Any) -> float:
    flush.sum().item()  # evict the last call's data from the caches: every call reads from memory
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(rows: int, args: argparse.Namespace) -> dict[str, Any]:
    """One row count: the step's medians (ms) and the derived bandwidths and ratios."""
    import torch

    from ..kernels import decode_attention, kv_int8
    from ..models.chattts.config import ModelConfig
    from ..models.chattts.gpt import Attention, KVCache

    cfg = ModelConfig.full().gpt
    layers = args.layers or cfg.num_layers
    kvh, d = cfg.num_kv_heads, cfg.head_dim
    g = torch.Generator().manual_seed(args.seed + rows)
    lengths = torch.randint(args.min_len, args.max_len + 1, (rows,), generator=g)
    last = lengths - 1
    slots = torch.randperm(rows, generator=g)  # rows gather their slots out of order
    k = [torch.randn(rows, kvh, args.max_len, d, generator=g).bfloat16() for _ in range(layers)]
    v = [torch.randn(rows, kvh, args.max_len, d, generator=g).bfloat16() for _ in range(layers)]
    q = torch.randn(rows, cfg.num_heads, 1, d, generator=g)
    scale = d**-0.5
    attn = Attention(cfg, 0)
    slot_list, last_list = slots.tolist(), last.tolist()
    nbytes = 2 * layers * kvh * d * 2 * int(lengths.sum())  # keys and values, bf16, each row's positions
    nbytes8 = 2 * layers * kvh * KVCache.vector_bytes(d, torch.int8) * int(lengths.sum())  # int8 with scales
    k8 = [kv_int8.quantize(t) for t in k]
    v8 = [kv_int8.quantize(t) for t in v]

    def torch_rows(kc: list, vc: list, sc: list | None = None) -> Callable[[], Any]:
        return lambda: [
            attn._attend_rows(q, kc[i], vc[i], slot_list, last_list, sc[i] if sc else None) for i in range(layers)
        ]

    buf = torch.ones(nbytes // 4)
    buf8 = torch.ones(nbytes8 // 4)
    flush = torch.ones(FLUSH_BYTES // 4)
    dst = torch.empty_like(buf)
    methods: dict[str, Callable[[], Any]] = {
        "read": lambda: buf.sum().item(),
        "read-int8": lambda: buf8.sum().item(),
        "copy": lambda: dst.copy_(buf),
        "torch-bf16": torch_rows(k, v),
    }
    qk = q[:, :, 0]
    if decode_attention.applies(k[0]):
        methods["kernel"] = lambda: [decode_attention.attend(qk, k[i], v[i], slots, last, scale) for i in range(layers)]
    if decode_attention.applies(k8[0][0]):
        methods["kernel-int8"] = lambda: [
            decode_attention.attend(qk, k8[i][0], v8[i][0], slots, last, scale, (k8[i][1], v8[i][1]))
            for i in range(layers)
        ]
    if not args.no_fp32:
        methods["torch-fp32"] = torch_rows([t.float() for t in k], [t.float() for t in v])
        scales8 = [(a[1], b[1]) for a, b in zip(k8, v8, strict=True)]
        methods["torch-int8"] = torch_rows([t[0] for t in k8], [t[0] for t in v8], scales8)
    with torch.inference_mode():
        for fn in methods.values():  # warm-up: first touches, lazy inits
            fn()
        times: dict[str, list[float]] = {name: [] for name in methods}
        for _ in range(args.rounds):
            for name, fn in methods.items():
                times[name].append(_time(fn, flush))
    ms = {name: 1000 * statistics.median(ts) for name, ts in times.items()}
    out: dict[str, Any] = {
        "rows": rows,
        "layers": layers,
        "kv_mb": round(nbytes / 1e6, 1),
        "kv_int8_mb": round(nbytes8 / 1e6, 1),
        "ms": {name: round(t, 2) for name, t in ms.items()},
        "read_gbs": round(nbytes / ms["read"] / 1e6, 1),
        "copy_gbs": round(nbytes / ms["copy"] / 1e6, 1),
    }
    if "kernel" in ms:
        out["kernel_gbs"] = round(nbytes / ms["kernel"] / 1e6, 1)
        out["kernel_of_read"] = round(ms["read"] / ms["kernel"], 2)
        for name in ("torch-bf16", "torch-fp32"):
            if name in ms:
                out[f"speedup_vs_{name}"] = round(ms[name] / ms["kernel"], 2)
    if "kernel-int8" in ms:
        out["int8_of_read"] = round(ms["read-int8"] / ms["kernel-int8"], 2)  # of its own (int8) read floor
        out["int8_of_bf16_read"] = round(ms["read"] / ms["kernel-int8"], 2)
        if "kernel" in ms:
            out["int8_speedup_vs_kernel"] = round(ms["kernel"] / ms["kernel-int8"], 2)
    return out


def main(args: argparse.Namespace) -> int:
    import torch

    from ..kernels import decode_attention

    torch.set_num_threads(args.threads)
    if not decode_attention.cpu_supported():
        print(f"note: the kernel needs AVX-512 (this CPU: {torch.backends.cpu.get_cpu_capability()})")
    results = [measure(int(r), args) for r in args.rows.split(",")]
    if args.json:
        print(json.dumps({"threads": args.threads, "results": results}))
        return 0
    print(f"{args.threads} threads; ms per step of {results[0]['layers']} layers; medians of {args.rounds} rounds")
    for r in results:
        kern = f"{r.get('kernel_gbs', '-')} GB/s = {r.get('kernel_of_read', '-')} of read"
        print(
            f"rows {r['rows']:>3}: {r['kv_mb']:>7} MB  read {r['read_gbs']} GB/s  copy {r['copy_gbs']} GB/s  "
            f"kernel {kern}  ms {r['ms']}  speedup: bf16 {r.get('speedup_vs_torch-bf16', '-')}x "
            f"fp32 {r.get('speedup_vs_torch-fp32', '-')}x"
        )
        print(
            f"          int8 cache {r['kv_int8_mb']:>7} MB  kernel-int8 {r.get('int8_of_read', '-')} of its read, "
            f"{r.get('int8_of_bf16_read', '-')} of bf16's, {r.get('int8_speedup_vs_kernel', '-')}x the bf16 kernel"
        )
    return 0
