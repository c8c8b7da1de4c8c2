"""What the audio-out features cost (issue 22): time stretch and resampling per second of audio, streamed in
the chunks a response sends, and a result-cache hit against a miss through a real server.

    python scripts/bench_audio_costs.py --model CKPT            # prints one JSON line
    python scripts/bench_audio_costs.py --model CKPT --skip-server

The audio is 10 s of a tone over noise (the work of atempo and libswresample does not depend on what the
audio says). Times are medians of ``--repeats`` runs on this process's thread; the server part starts
``chattts-serve serve`` on 127.0.0.1 with the result cache on, sends seeded requests, and times each from
the request to the last byte: a miss (a new seed each time: the full synthesis) and a hit (the same body
again: the cache's bytes). Benchmarks belong on a quiet machine; record the CPU with the figures.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time

import numpy as np

from chattts_serve.audio.encode import StreamingEncoder
from chattts_serve.audio.resample import StreamingResampler
from chattts_serve.audio.stretch import StreamingStretcher
from chattts_serve.bench.common import wait_ready
from chattts_serve.cpu import probe
from chattts_serve.models.chattts.config import SAMPLE_RATE

CHUNK_S = 0.5


def _audio(seconds: float = 10.0) -> np.ndarray:
    rng = np.random.default_rng(0)
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    return (0.3 * np.sin(2 * np.pi * 220 * t) + 0.05 * rng.standard_normal(t.size)).astype(np.float32)


def _chunks(pcm: np.ndarray) -> list[np.ndarray]:
    step = int(CHUNK_S * SAMPLE_RATE)
    return [pcm[i : i + step] for i in range(0, len(pcm), step)]


def _median_ms_per_audio_s(fn, pcm: np.ndarray, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(_chunks(pcm))
        times.append(time.perf_counter() - t0)
    return round(1000 * statistics.median(times) / (len(pcm) / SAMPLE_RATE), 3)


def _streamed(make):
    """A run over a response's chunks through a fresh ``make()`` (``process`` each chunk, then ``flush``)."""

    def go(chunks):
        f = make()
        for c in chunks:
            f.process(c)
        f.flush()

    return go


def stretch_costs(pcm: np.ndarray, repeats: int) -> dict[str, float]:
    return {
        f"x{f}": _median_ms_per_audio_s(_streamed(lambda f=f: StreamingStretcher(f, SAMPLE_RATE)), pcm, repeats)
        for f in (0.5, 1.5, 2.0, 4.0)
    }


def resample_costs(pcm: np.ndarray, repeats: int) -> dict[str, float]:
    return {
        f"{r}Hz": _median_ms_per_audio_s(_streamed(lambda r=r: StreamingResampler(r, SAMPLE_RATE)), pcm, repeats)
        for r in (8000, 16000, 44100, 48000)
    }


def telephony_costs(pcm: np.ndarray, repeats: int) -> dict[str, float]:
    """Resample to 8 kHz and encode G.711, as a ``mulaw`` / ``alaw`` response does."""

    def run(fmt):
        def go(chunks):
            enc = StreamingEncoder(fmt, sample_rate=8000, model_rate=SAMPLE_RATE)
            for c in chunks:
                enc.write(c)
            enc.finish()

        return go

    return {fmt: _median_ms_per_audio_s(run(fmt), pcm, repeats) for fmt in ("mulaw", "alaw", "pcm")}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cache_costs(model: str, requests: int, tokens: int) -> dict[str, float]:
    import httpx

    port = _free_port()
    cmd = [sys.executable, "-m", "chattts_serve.cli", "serve", "--model", model, "--port", str(port)]
    proc = subprocess.Popen([*cmd, "--cache-mb", "64"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, proc, 300)
        body = {"text": "今天天气真不错，我们一起去公园散步吧。", "format": "wav", "refine_text": False}
        body.update(min_new_tokens=tokens, max_new_tokens=tokens)
        miss, hit = [], []
        with httpx.Client(base_url=base, timeout=600) as client:
            for i in range(requests):
                for bucket, want in ((miss, "miss"), (hit, "hit")):
                    t0 = time.perf_counter()
                    r = client.post("/v1/tts", json={**body, "seed": 1000 + i})
                    bucket.append(time.perf_counter() - t0)
                    if r.status_code != 200 or r.headers.get("X-Cache") != want:
                        raise RuntimeError(f"expected a {want}: {r.status_code} {r.headers.get('X-Cache')}")
        return {
            "tokens": tokens,
            "miss_ms_p50": round(1000 * statistics.median(miss), 2),
            "hit_ms_p50": round(1000 * statistics.median(hit), 3),
            "hit_ms_max": round(1000 * max(hit), 3),
        }
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint directory (for the cache part)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--requests", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=94, help="audio tokens per request (94 = 2 s)")
    ap.add_argument("--skip-server", action="store_true")
    args = ap.parse_args()
    pcm = _audio()
    out = {
        "bench": "audio_costs",
        "cpu": probe().describe(),
        "stretch_ms_per_audio_s": stretch_costs(pcm, args.repeats),
        "resample_ms_per_audio_s": resample_costs(pcm, args.repeats),
        "telephony_encode_ms_per_audio_s": telephony_costs(pcm, args.repeats),
    }
    if not args.skip_server:
        if not args.model:
            ap.error("--model is needed for the cache part (or --skip-server)")
        out["cache"] = cache_costs(args.model, args.requests, args.tokens)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
