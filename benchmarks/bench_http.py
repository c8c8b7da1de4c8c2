"""Time to first audio byte over HTTP, per format, and under concurrency, against a real server.

    python benchmarks/bench_http.py --ckpt checkpoints/full --steps 100 --concurrency 16

Starts ``chattts-serve serve`` on 127.0.0.1 (or use --url for a running one), then: one stream at a
time per response format (median of --repeats), and N concurrent /v1/audio/speech streams (p50/p99
of time to first byte and of total latency). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from common import full_checkpoint

FORMATS = ("pcm", "wav", "mp3", "opus", "aac", "flac")
TEXT = "今天天气真不错，我们一起去公园散步吧。"


def one(url: str, fmt: str, steps: int, seed: int) -> tuple[float, float, int]:
    body = {
        "model": "tts-1",
        "voice": "alloy",
        "input": TEXT,
        "response_format": fmt,
        "seed": seed,
        "min_new_tokens": steps,
        "max_new_tokens": steps,
        "refine_text": False,
    }
    t0 = time.perf_counter()
    first, size = None, 0
    with httpx.stream("POST", url + "/v1/audio/speech", json=body, timeout=600) as r:
        r.raise_for_status()
        for chunk in r.iter_bytes():
            if first is None and chunk:
                first = time.perf_counter() - t0
            size += len(chunk)
    return first, time.perf_counter() - t0, size


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", default="checkpoints/full")
    ap.add_argument("--url", default=None)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    proc = None
    url = args.url
    if url is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "chattts_serve.cli",
                "serve",
                "--model",
                str(full_checkpoint(args.ckpt)),
                "--port",
                str(port),
                "--threads",
                str(args.threads),
                "--max-num-seqs",
                str(max(args.concurrency, 1)),
                "--max-model-len",
                str(args.steps + 256),
                "--voices-db",
                "/tmp/bench-voices.sqlite3",
                "--log-level",
                "warning",
            ],
            env={**os.environ},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
    try:
        per_format = {}
        for fmt in FORMATS:
            runs = [one(url, fmt, args.steps, 1 + i) for i in range(args.repeats)]
            per_format[fmt] = {
                "ttfb_s": round(statistics.median(r[0] for r in runs), 3),
                "total_s": round(statistics.median(r[1] for r in runs), 3),
            }
        n = args.concurrency
        with ThreadPoolExecutor(n) as pool:
            t0 = time.perf_counter()
            runs = list(pool.map(lambda i: one(url, "pcm", args.steps, 100 + i), range(n)))
            wall = time.perf_counter() - t0
        ttfb, total = [r[0] for r in runs], [r[1] for r in runs]
        audio_s = n * (512 * args.steps - 256) / 24000
        out = {
            "bench": "http",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "steps": args.steps,
            "single_stream": per_format,
            "concurrent": {
                "n": n,
                "ttfb_p50_s": round(pct(ttfb, 0.5), 3),
                "ttfb_p99_s": round(pct(ttfb, 0.99), 3),
                "latency_p50_s": round(pct(total, 0.5), 3),
                "latency_p99_s": round(pct(total, 0.99), 3),
                "audio_s_per_s": round(audio_s / wall, 3),
            },
        }
        print(json.dumps(out))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)


if __name__ == "__main__":
    main()
