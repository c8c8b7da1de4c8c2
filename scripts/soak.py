"""Soak: many mixed requests against a real `chattts-serve serve` on 127.0.0.1; samples the server's
RSS, threads, open files and gauges; after the run (and idle) every gauge must be back to 0 and RSS
growth after warm-up small.

    python scripts/soak.py --model CKPT [--requests 400] [--concurrency 8] [--warmup 50]

Warm-up: the server's caches of compiled CPU kernels (bounded, see ``engine/onednn.py``) fill with the
first ~100-150 requests of this mix; measure growth after them (``--warmup 150``).

One JSON line: RSS after warm-up and at the end (MB) and the growth in %, threads and open files
before/after, the request outcomes. The requests are seeded, so the result cache (``--cache-mb``) fills as
they run: that is memory the server was told to use, not a leak. The bar (``--max-growth-pct``) is judged
net of it: RSS growth minus the growth of ``chattts_cache_bytes`` (which counts what the entries really
hold: tests/server/test_cache.py). Exit 1 when a gauge is not back to 0 or the net growth passes the bar.

The mix: OpenAI-SDK-shaped /v1/audio/speech requests in every
format, 16-48 tokens, refine on (the default), 10 % closed after the first chunk, 5 % SSE, some
native /v1/tts with several sentences. Loopback only; bounded in count and time.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from chattts_serve.bench.common import wait_ready

FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm", "mulaw", "alaw")
TEXTS = ("今天天气很好。", "你好，很高兴认识你。", "Hello there, how are you?", "我们去公园散步吧。明天见。")


def proc_status(pid: int) -> dict[str, float]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "Threads"):
            fields[key] = float(value.split()[0])
    fields["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    return {"rss_mb": fields["VmRSS"] / 1024, "threads": fields["Threads"], "fds": fields["fds"]}


IDLE_GAUGES = ("chattts_requests_in_flight", "chattts_kv_slots_used", "chattts_queue_depth")
"""Back to 0 once the server is idle."""
CACHE_BYTES = "chattts_cache_bytes"


def gauges(base: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(base + "/metrics", timeout=30).text.splitlines():
        for name in (*IDLE_GAUGES, CACHE_BYTES):
            if line.startswith(name + " "):
                out[name] = float(line.split()[-1])
    return out


def net_growth_mb(rss_start_mb: float, rss_end_mb: float, cache_start: float, cache_end: float) -> float:
    """RSS growth that the result cache does not account for (its bytes: ``chattts_cache_bytes``)."""
    return (rss_end_mb - rss_start_mb) - (cache_end - cache_start) / 2**20


def one(base: str, i: int, rng: random.Random) -> str:
    tokens = rng.randint(16, 48)
    fmt = rng.choice(FORMATS)
    close_early = rng.random() < 0.10
    if rng.random() < 0.15:
        url, body = "/v1/tts", {"text": rng.choice(TEXTS), "format": fmt, "max_new_tokens": tokens, "seed": i}
    else:
        body = {
            "model": "tts-1",
            "voice": rng.choice(("alloy", "echo", "nova")),
            "input": rng.choice(TEXTS),
            "response_format": fmt,
            "max_new_tokens": tokens,
            "seed": i,
        }
        if rng.random() < 0.05:
            body["stream_format"] = "sse"
        url = "/v1/audio/speech"
    try:
        with httpx.stream("POST", base + url, json=body, timeout=120) as r:
            if r.status_code != 200:
                return f"http-{r.status_code}"
            for _ in r.iter_raw():
                if close_early:
                    return "closed-early"
        return "ok"
    except httpx.HTTPError as exc:
        return type(exc).__name__


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--port", type=int, default=18731)
    ap.add_argument("--extra", default="", help="more serve flags, space-separated")
    ap.add_argument(
        "--max-growth-pct", type=float, default=5.0, help="bar: RSS growth after warm-up, net of the result cache"
    )
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    base = f"http://127.0.0.1:{args.port}"
    cmd = [
        sys.executable,
        "-m",
        "chattts_serve.cli",
        "serve",
        "--model",
        args.model,
        "--port",
        str(args.port),
        "--voices-db",
        str(tmp / "v.sqlite3"),
        "--threads",
        "1",
        "--log-level",
        "warning",
        *args.extra.split(),
    ]
    log = open(tmp / "server.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        try:
            wait_ready(base, proc, 180)
        except RuntimeError as exc:
            raise SystemExit(f"{exc}; log: {tmp / 'server.log'}") from None
        rng = random.Random(0)
        outcomes: dict[str, int] = {}
        samples = []
        t0 = time.monotonic()

        def batch(start: int, n: int) -> None:
            with ThreadPoolExecutor(args.concurrency) as pool:
                seeds = [random.Random(rng.random()) for _ in range(n)]
                for result in pool.map(lambda k: one(base, start + k, seeds[k]), range(n)):
                    outcomes[result] = outcomes.get(result, 0) + 1

        batch(0, args.warmup)
        after_warmup = proc_status(proc.pid)
        cache_after_warmup = gauges(base).get(CACHE_BYTES, 0.0)
        done = args.warmup
        while done < args.requests:
            n = min(50, args.requests - done)
            batch(done, n)
            done += n
            samples.append({"requests": done, **proc_status(proc.pid)})
            samples[-1]["t_s"] = time.monotonic() - t0
            print(json.dumps(samples[-1]), file=sys.stderr, flush=True)  # progress: a long run may be cut short
        time.sleep(2)  # idle
        end = proc_status(proc.pid)
        g = gauges(base)
        cache_end = g.pop(CACHE_BYTES, 0.0)
        net_mb = net_growth_mb(after_warmup["rss_mb"], end["rss_mb"], cache_after_warmup, cache_end)
        net_pct = 100 * net_mb / after_warmup["rss_mb"]
        result = {
            "bench": "soak",
            "requests": args.requests,
            "concurrency": args.concurrency,
            "wall_s": round(time.monotonic() - t0, 1),
            "outcomes": outcomes,
            "rss_after_warmup_mb": round(after_warmup["rss_mb"], 1),
            "rss_end_mb": round(end["rss_mb"], 1),
            "rss_growth_pct": round(100 * (end["rss_mb"] - after_warmup["rss_mb"]) / after_warmup["rss_mb"], 2),
            "cache_mb": [round(cache_after_warmup / 2**20, 1), round(cache_end / 2**20, 1)],
            "rss_growth_net_of_cache_pct": round(net_pct, 2),
            "max_growth_pct": args.max_growth_pct,
            "threads": [after_warmup["threads"], end["threads"]],
            "fds": [after_warmup["fds"], end["fds"]],
            "gauges_after_idle": g,
            "samples": [{k: round(v, 1) for k, v in s.items()} for s in samples],
        }
        print(json.dumps(result))
        return 0 if all(v == 0 for v in g.values()) and net_pct <= args.max_growth_pct else 1
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


if __name__ == "__main__":
    sys.exit(main())
