"""The short soak (the long one is ``scripts/soak.py``): mixed requests against a real server, some
closed after the first chunk; afterwards every gauge is back to 0 and no file or thread is left over."""

from __future__ import annotations

import os
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from .conftest import HTTP_TIMEOUT, metric, start_server, wait_until

pytestmark = pytest.mark.soak

FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")
TEXTS = ("今天天气很好。", "你好，很高兴认识你。", "Hello there, how are you?", "我们去公园散步吧。明天见。")


def _proc(pid: int) -> tuple[int, int]:
    """(open files, threads) of a process."""
    threads = next(
        int(line.split()[1])
        for line in Path(f"/proc/{pid}/status").read_text().splitlines()
        if line.startswith("Threads")
    )
    return len(os.listdir(f"/proc/{pid}/fd")), threads


def _one(base: str, i: int) -> str:
    rng = random.Random(i)
    body = {
        "model": "tts-1",
        "voice": rng.choice(("alloy", "echo")),
        "input": rng.choice(TEXTS),
        "seed": i,
        "response_format": rng.choice(FORMATS),
        "max_new_tokens": rng.randint(16, 48),
        "refine_text": False,
    }
    if i % 7 == 3:
        body["stream_format"] = "sse"
    with httpx.stream("POST", base + "/v1/audio/speech", json=body, timeout=HTTP_TIMEOUT) as r:
        assert r.status_code == 200
        for _ in r.iter_raw():
            if i % 10 == 5:  # a client that goes away after the first chunk
                return "closed"
    return "ok"


def test_short_soak_leaves_nothing_behind(tiny_ckpt, tmp_path):
    with start_server(tiny_ckpt, tmp_path, "--max-num-seqs", "4", "--no-warmup") as srv:
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda i: _one(srv.base, i), range(8)))  # warm-up: threads and caches
        assert wait_until(lambda: metric(srv.base, "chattts_requests_in_flight") == 0, timeout=30)
        fds0, threads0 = _proc(srv.proc.pid)
        with ThreadPoolExecutor(4) as pool:
            outcomes = list(pool.map(lambda i: _one(srv.base, i), range(8, 68)))
        assert outcomes.count("closed") >= 5 and outcomes.count("ok") >= 50
        for gauge in ("chattts_requests_in_flight", "chattts_kv_slots_used", "chattts_queue_depth"):
            assert wait_until(lambda g=gauge: metric(srv.base, g) == 0, timeout=30), gauge
        assert wait_until(lambda: _proc(srv.proc.pid)[0] <= fds0 + 2, timeout=30), (fds0, _proc(srv.proc.pid))
        # Worker threads come from bounded pools: they may grow to the pools' size, never with the requests.
        assert _proc(srv.proc.pid)[1] <= threads0 + 8
