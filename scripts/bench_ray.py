"""Scale-out figures on Ray, one JSON line per command (a tool, not a test: run it on a quiet machine).

    python scripts/bench_ray.py footprint --model CKPT --replicas 2
        start-up (cluster, Serve, first answer) and each replica's RSS, once
    python scripts/bench_ray.py serve --model CKPT --replicas 1,2 --concurrency 8 --requests 32 --tokens 200
        the same load through Serve's proxy with 1, then 2 replicas, in one run: audio s per wall s, TTFB
    python scripts/bench_ray.py batch --model CKPT --num-texts 64 --num-workers 2 --tokens 200
        `chattts-serve ray batch` vs `chattts-serve synthesize --input` (one process) on the same texts;
        each wall time includes its start-up (cluster, model loads): give it enough texts to amortise

Loopback only (a local cluster on 127.0.0.1). Replicas get ``--num-cpus-per-replica`` CPUs each and as many
torch threads; on a box with fewer cores than replicas x threads the figures measure contention.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before ray is imported: loopback only
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import httpx  # noqa: E402

SAMPLE_RATE = 24000
TEXT = "今天天气真不错，我们一起去公园散步吧。"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def body(tokens: int, seed: int = 1) -> dict:
    return {
        "text": TEXT,
        "format": "pcm",
        "seed": seed,
        "refine_text": False,
        "min_new_tokens": tokens,
        "max_new_tokens": tokens,
    }


def one_stream(base: str, tokens: int, seed: int) -> dict:
    t0 = time.perf_counter()
    first, size = None, 0
    with httpx.stream("POST", base + "/v1/tts", json=body(tokens, seed), timeout=600) as r:
        r.raise_for_status()
        replica = r.headers.get("x-chattts-replica", "")
        for chunk in r.iter_bytes():
            if first is None and chunk:
                first = time.perf_counter() - t0
            size += len(chunk)
    return {
        "ttfb_s": first or 0.0,
        "wall_s": time.perf_counter() - t0,
        "audio_s": size / 2 / SAMPLE_RATE,
        "replica": replica,
    }


def deploy(args, replicas: int, port: int):
    from chattts_serve.distributed.serve_app import deploy as serve_deploy
    from chattts_serve.distributed.settings import ServeSettings

    server = {
        "model": args.model,
        "port": port,
        "max_num_seqs": args.max_num_seqs,
        "precision": args.precision,
        "threads": max(1, int(args.num_cpus_per_replica)),
        "voices_db": str(Path(args.tmp) / "voices.sqlite3"),
    }
    t0 = time.perf_counter()
    serve_deploy(ServeSettings(server=server, num_replicas=replicas, num_cpus=args.num_cpus_per_replica))
    return time.perf_counter() - t0


def replica_pids(base: str, n: int, tries: int = 200) -> dict[str, int]:
    seen: dict[str, int] = {}
    for _ in range(tries):
        rid, pid = httpx.get(base + "/health", timeout=30).headers["x-chattts-replica"].split("/")
        seen[rid] = int(pid)
        if len(seen) >= n:
            break
    return seen


def cmd_footprint(args) -> dict:
    t0 = time.perf_counter()
    import ray

    from chattts_serve.distributed.cluster import connect

    connect(None, num_cpus=args.num_cpus)
    t_cluster = time.perf_counter() - t0
    port = free_port()
    t_deploy = deploy(args, args.replicas[0], port)
    base = f"http://127.0.0.1:{port}"
    first = one_stream(base, 8, 1)
    t_first = time.perf_counter() - t0
    pids = replica_pids(base, args.replicas[0])
    out = {
        "cluster_start_s": t_cluster,
        "deploy_s": t_deploy,
        "first_answer_after_start_s": t_first,
        "first_request_wall_s": first["wall_s"],
        "replica_rss_mib": {r: rss_mib(p) for r, p in pids.items()},
    }
    from ray import serve

    serve.shutdown()
    ray.shutdown()
    return out


def cmd_serve(args) -> dict:
    import ray
    from ray import serve

    from chattts_serve.distributed.cluster import connect

    connect(None, num_cpus=args.num_cpus)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    runs = []
    try:
        for n in args.replicas:
            deploy_s = deploy(args, n, port)
            one_stream(base, 8, 0)  # warm every code path once
            t0 = time.perf_counter()
            with ThreadPoolExecutor(args.concurrency) as pool:
                results = list(pool.map(lambda i: one_stream(base, args.tokens, i), range(args.requests)))
            wall = time.perf_counter() - t0
            audio = sum(r["audio_s"] for r in results)
            runs.append(
                {
                    "replicas": n,
                    "deploy_s": deploy_s,
                    "wall_s": wall,
                    "audio_s": audio,
                    "audio_s_per_wall_s": audio / wall,
                    "ttfb_median_s": statistics.median(r["ttfb_s"] for r in results),
                    "replicas_used": len({r["replica"].split("/")[0] for r in results}),
                }
            )
    finally:
        serve.shutdown()
        ray.shutdown()
    base_rate = runs[0]["audio_s_per_wall_s"]
    for r in runs:
        r["speedup_vs_first"] = r["audio_s_per_wall_s"] / base_rate
    return {"runs": runs, "concurrency": args.concurrency, "requests": args.requests, "tokens": args.tokens}


def _run(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def cmd_batch(args) -> dict:
    tmp = Path(args.tmp)
    texts = tmp / "texts.txt"
    texts.write_text("".join(f"{TEXT}第{i}句。\n" for i in range(args.num_texts)), encoding="utf-8")
    common = [
        "--model",
        args.model,
        "--seed",
        "1",
        "--no-refine",
        "--min-new-tokens",
        str(args.tokens),
        "--max-new-tokens",
        str(args.tokens),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--precision",
        args.precision,
    ]
    exe = [sys.executable, "-m", "chattts_serve.cli"]
    single = _run(exe + ["synthesize", "--input", str(texts), "--output-dir", str(tmp / "single"), *common])
    ray_args = ["--num-workers", str(args.num_workers), "--num-cpus-per-worker", str(args.num_cpus_per_worker)]
    if args.num_cpus:
        ray_args += ["--num-cpus", str(args.num_cpus)]
    batch = _run(
        exe
        + ["ray", "batch", "--input", str(texts), "--output-dir", str(tmp / "ray"), "--no-progress", *ray_args, *common]
    )
    audio = args.num_texts * (512 * args.tokens - 256) / SAMPLE_RATE
    same = all((tmp / "ray" / p.name).read_bytes() == p.read_bytes() for p in sorted((tmp / "single").glob("*.wav")))
    return {
        "num_texts": args.num_texts,
        "tokens": args.tokens,
        "num_workers": args.num_workers,
        "single_process_wall_s": single,
        "ray_batch_wall_s": batch,
        "audio_s": audio,
        "single_audio_s_per_wall_s": audio / single,
        "ray_audio_s_per_wall_s": audio / batch,
        "speedup": single / batch,
        "identical_files": same,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    for name in ("footprint", "serve", "batch"):
        p = sub.add_parser(name)
        p.add_argument("--model", required=True)
        p.add_argument("--precision", default="fp32")
        p.add_argument("--max-num-seqs", type=int, default=8, help="KV slots per engine (and texts per Ray batch)")
        p.add_argument("--num-cpus", type=int, help="CPUs of the local cluster (default: all)")
        p.add_argument("--tokens", type=int, default=200, help="audio tokens per request (46.875 per second)")
        p.add_argument("--replicas", type=lambda v: [int(x) for x in v.split(",")], default=[1, 2])
        p.add_argument("--num-cpus-per-replica", type=float, default=1.0)
        p.add_argument("--concurrency", type=int, default=8)
        p.add_argument("--requests", type=int, default=32)
        p.add_argument("--num-texts", type=int, default=64)
        p.add_argument("--num-workers", type=int, default=2)
        p.add_argument("--num-cpus-per-worker", type=float, default=1.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        args.tmp = tmp
        result = {"footprint": cmd_footprint, "serve": cmd_serve, "batch": cmd_batch}[args.command](args)
    line = {
        "tool": "bench_ray",
        "command": args.command,
        "date": datetime.now(timezone.utc).isoformat(),
        "machine": platform.node(),
        "cpus": os.cpu_count(),
        "model": args.model,
        "precision": args.precision,
        **result,
    }
    print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
