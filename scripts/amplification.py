"""Amplification: the most one request can cost, per synthesis route, derived from the limits and measured.

For each route (``/v1/audio/speech``, ``/v1/tts``, ``/v1/tts/captioned``, ``/v1/dialogue``, the WebSocket,
Wyoming) it states the most audio seconds, response bytes and engine steps one request (of at most
``max_body_bytes``) can cause, as a formula of the server's limits, then sends the worst requests it knows of to
a live server on the tiny random checkpoint and measures what they got: audio, bytes, engine steps (from
``chattts_audio_seconds``, 46.875 steps a second of the model's audio) and the event loop's worst lag while
they ran (a probe polls ``/health`` every 10 ms; the lag is its slowest answer). The measured values must
stay within the bounds (the script exits 1 otherwise).

    python scripts/amplification.py                 # default limits (max_audio_seconds 600): minutes on a CPU
    python scripts/amplification.py --quick         # max_audio_seconds 10: seconds (tests/test_amplification.py)
    python scripts/amplification.py --markdown      # the table for the README's "Security and limits"

Loopback only; every request is bounded by the server's own limits and a client timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import math
import multiprocessing
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from chattts_serve.audio.resample import MAX_RATE
from chattts_serve.models.chattts.config import SAMPLE_RATE, TOKENS_PER_SECOND
from chattts_serve.sampling_params import OPTION_BOUNDS
from chattts_serve.server.budget import MAX_PAUSE_SECONDS
from chattts_serve.server.config import ServerConfig
from chattts_serve.server.protocol import MAX_TURNS
from chattts_serve.server.wyoming import SAMPLES_PER_CHUNK

MAX_TOKENS = int(OPTION_BOUNDS["max_new_tokens"]["le"])
PROMPT_ROOM = 128
"""Positions of a slot left for a sentence's prompt (the worst requests' prompts are a few dozen tokens)."""
EVENT_BYTES = 128
"""A Wyoming event's JSON header (type, rate, width, channels, timestamp, lengths) is under this."""
SAY = "今天天气真不错。"
PLAIN = {"seed": 3, "refine_text": False, "first_sentence_voice": False}


@dataclass
class Row:
    route: str
    worst: str
    """The worst request tried (and what the bound assumes)."""
    audio_s: float
    bytes: int
    steps: int
    formula: str
    measured: dict = field(default_factory=dict)


def bounds(limit_s: float, cfg: ServerConfig) -> list[Row]:
    """Each route's bounds under ``limit_s`` (``max_audio_seconds``) and ``cfg``'s other limits."""
    steps = math.floor(limit_s * TOKENS_PER_SECOND)
    pcm = 2 * MAX_RATE * limit_s + 44  # 16-bit at the highest sample_rate, a wav header
    b64 = 4 * math.ceil(pcm / 3)
    stream_s = cfg.ws.max_audio_seconds  # a WebSocket (or Wyoming) stream's parts share it
    wy_chunks = math.ceil(SAMPLE_RATE * limit_s / SAMPLES_PER_CHUNK)  # Wyoming's audio is the model's rate
    wy_bytes = 2 * SAMPLE_RATE * limit_s + EVENT_BYTES * (wy_chunks + 3)
    return [
        Row("/v1/audio/speech", "speed 0.25 stretch, pcm 48 kHz, min = max tokens", limit_s, int(b64 * 1.01), steps,
            "L; SSE: 4/3 x (2 x 48000 x L) + 1 % events; L x 46.875 steps"),
        Row("/v1/tts", "speed 0.25 stretch, wav 48 kHz, stream false", limit_s, int(pcm), steps,
            "L; 2 x 48000 x L + 44; L x 46.875 steps"),
        Row("/v1/tts (SSML)", f"up to {MAX_TURNS} <voice> runs, speed 0.25 stretch, pcm 48 kHz", limit_s, int(pcm),
            steps, "turns, pauses and stretch share L"),
        Row("/v1/tts/captioned", "wav 48 kHz, sentences of min = max tokens", limit_s, int(b64 * 1.01), steps,
            "L (no stretch); base64 4/3 x (2 x 48000 x L) + JSON"),
        Row("/v1/dialogue", f"{MAX_TURNS} turns, pauses up to {MAX_PAUSE_SECONDS:g} s, pcm 48 kHz", limit_s, int(pcm),
            steps, "(speech + pauses) <= L; pauses <= 60 s"),
        Row("WebSocket", "one stream: parts share ws_max_audio_seconds (W), L each", stream_s,
            int(2 * MAX_RATE * stream_s), math.floor(stream_s * TOKENS_PER_SECOND),
            "W = ws_max_audio_seconds for the stream (stretched), L per part; 2 x 48000 x W; W x 46.875 steps"),
        Row("Wyoming", "synthesize, chattts min = max tokens", limit_s, int(wy_bytes), steps,
            f"L per synthesize (a stream: its parts share W, as the WebSocket's); 2 x 24000 x L + {EVENT_BYTES} per "
            "event of "
            f"{SAMPLES_PER_CHUNK} samples"),
    ]  # fmt: skip


# ------------------------------------------------------------------------------------------ measuring


def _probe(base: str, pid: int, worst_ms, rss_mb, rss0, stop) -> None:
    """The probe's own process: a client parsing megabytes of SSE, JSON or Wyoming events holds its process's
    GIL, and a probe thread beside it would count that as the server's lag."""
    with httpx.Client(timeout=30) as c:
        while not stop.is_set():
            t0 = time.perf_counter()
            c.get(base + "/health")
            elapsed = 1000 * (time.perf_counter() - t0)
            with worst_ms.get_lock():
                worst_ms.value = max(worst_ms.value, elapsed)
            with rss_mb.get_lock():
                rss_mb.value = max(rss_mb.value, _rss(pid) - rss0.value)
            time.sleep(0.01)


def _rss(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return float(line.split()[1]) / 1024
    return 0.0


class LoopProbe:
    """Polls ``/health`` every 10 ms from a process of its own; ``worst_ms``: its slowest answer since
    ``reset`` (the server's event-loop lag, its GIL waits included); ``rss_mb``: the server's largest RSS
    growth since ``reset``."""

    def __init__(self, base: str, pid: int) -> None:
        ctx = multiprocessing.get_context("spawn")  # no fork of a process that holds threads
        self.pid = pid
        self._worst, self._rss_mb, self._rss0 = ctx.Value("d", 0.0), ctx.Value("d", 0.0), ctx.Value("d", 0.0)
        self._stop = ctx.Event()
        self.reset()
        self._proc = ctx.Process(
            target=_probe, args=(base, pid, self._worst, self._rss_mb, self._rss0, self._stop), daemon=True
        )
        self._proc.start()

    @property
    def worst_ms(self) -> float:
        return self._worst.value

    @property
    def rss_mb(self) -> float:
        return self._rss_mb.value

    def reset(self) -> None:
        self._rss0.value = _rss(self.pid)
        with self._worst.get_lock():
            self._worst.value = 0.0
        with self._rss_mb.get_lock():
            self._rss_mb.value = 0.0

    def stop(self) -> None:
        self._stop.set()
        self._proc.join(10)


def _model_seconds(base: str) -> float:
    for line in httpx.get(base + "/metrics", timeout=30).text.splitlines():
        if line.startswith("chattts_audio_seconds_total "):
            return float(line.split()[1])
    return 0.0


def _split(tokens: int, cfg: ServerConfig) -> tuple[int, int]:
    """``tokens`` of audio as sentences that each fit a KV slot with their prompt: (sentences, tokens each)."""
    per_pass = min(MAX_TOKENS, cfg.engine.scheduler.max_model_len - PROMPT_ROOM)
    n = max(1, math.ceil(tokens / per_pass))
    return n, tokens // n


def _pcm_seconds(nbytes: int, rate: int, header: int = 0) -> float:
    return (nbytes - header) / 2 / rate


def worst_requests(limit_s: float, cfg: ServerConfig) -> dict[str, list]:
    """Per route: (kind, request) pairs at the edge of ``limit_s``."""
    budget = math.floor(limit_s * TOKENS_PER_SECOND)
    slow_n, slow_t = _split(math.floor(limit_s * 0.25 * TOKENS_PER_SECOND), cfg)
    full_n, full_t = _split(budget, cfg)
    stretch = {"speed": 0.25, "speed_mode": "stretch"}
    pause_ms = min(5000, math.floor(min(MAX_PAUSE_SECONDS, limit_s / 2) * 1000 / (MAX_TURNS - 1)))
    per_pass = min(MAX_TOKENS, cfg.engine.scheduler.max_model_len - PROMPT_ROOM)
    turn_s = (limit_s - pause_ms * (MAX_TURNS - 1) / 1000) / MAX_TURNS
    turn_t = min(per_pass, math.floor(turn_s * TOKENS_PER_SECOND))
    room = limit_s * 0.25  # speed 0.25: the model's audio and the 300 ms pauses between runs
    runs = max(k for k in range(1, MAX_TURNS + 1) if 0.3 * (k - 1) <= room / 2)
    runs_t = min(per_pass, math.floor((room - 0.3 * (runs - 1)) / runs * TOKENS_PER_SECOND))
    voices = ("alloy", "nova")
    ssml = "<speak>" + "".join(f'<voice name="{voices[i % 2]}">{SAY}</voice>' for i in range(runs)) + "</speak>"
    tok = lambda t: {"min_new_tokens": t, "max_new_tokens": t}  # noqa: E731
    speech = {
        "model": "tts-1",
        "voice": "alloy",
        "input": SAY * slow_n,
        "response_format": "pcm",
        "sample_rate": MAX_RATE,
    }
    return {
        "/v1/audio/speech": [("http", {**speech, **PLAIN, **stretch, **tok(slow_t)}),
                             ("sse", {**speech, **PLAIN, **stretch, **tok(slow_t), "stream_format": "sse"})],
        "/v1/tts": [("http", {"text": SAY * slow_n, "format": "wav", "sample_rate": MAX_RATE, "stream": False,
                              **PLAIN, **stretch, **tok(slow_t)})],
        "/v1/tts (SSML)": [("http", {"text": ssml, "format": "pcm", "sample_rate": MAX_RATE, **PLAIN, **stretch,
                                     **tok(runs_t)})],
        "/v1/tts/captioned": [("captioned", {"text": SAY * full_n, "format": "wav", "sample_rate": MAX_RATE,
                                             **PLAIN, **tok(full_t)})],
        "/v1/dialogue": [("http", {"turns": [{"text": SAY, "voice": "alloy", **PLAIN, **tok(max(1, turn_t))}
                                             for _ in range(MAX_TURNS)],
                                   "format": "pcm", "sample_rate": MAX_RATE, "pause_ms": pause_ms})],
        "WebSocket": [("ws", {"text": SAY * 3, "format": "pcm", **PLAIN, **stretch,
                              **tok(_split(math.floor(limit_s * 0.25 * TOKENS_PER_SECOND), cfg)[1])})],
        "Wyoming": [("wyoming", {"text": SAY * full_n, "chattts": {**PLAIN, **tok(full_t)}})],
    }  # fmt: skip


def _audio_of(kind: str, body: dict, r: httpx.Response) -> tuple[float, int]:
    """(client audio seconds, response bytes) of an HTTP answer."""
    rate = body.get("sample_rate") or SAMPLE_RATE
    if kind == "sse":
        audio = b"".join(
            base64.b64decode(json.loads(line[6:])["audio"])
            for line in r.text.splitlines()
            if line.startswith("data: ") and '"speech.audio.delta"' in line
        )
        return _pcm_seconds(len(audio), rate), len(r.content)
    if kind == "captioned":
        return r.json()["duration_s"], len(r.content)
    header = 44 if body.get("format") == "wav" else 0
    return _pcm_seconds(len(r.content), rate, header), len(r.content)


async def _ws(base: str, body: dict) -> tuple[float, int]:
    import websockets

    url = base.replace("http://", "ws://") + "/v1/tts/stream"
    text = body.pop("text")
    nbytes = 0
    async with websockets.connect(url, max_size=None) as ws:
        await ws.send(json.dumps({"type": "start", **body}))
        for sentence in text.split("。")[:-1]:  # one part each
            await ws.send(json.dumps({"type": "text", "text": sentence + "。"}))
        await ws.send(json.dumps({"type": "end"}))
        async for msg in ws:
            if isinstance(msg, bytes):
                nbytes += len(msg)
            elif json.loads(msg).get("type") in ("done", "end", "error"):
                break
    return _pcm_seconds(nbytes, SAMPLE_RATE), nbytes


async def _wyoming(port: int, body: dict) -> tuple[float, int]:
    from wyoming.audio import AudioChunk, AudioStop
    from wyoming.client import AsyncTcpClient
    from wyoming.event import Event

    nbytes = samples = 0
    async with AsyncTcpClient("127.0.0.1", port) as client:
        await client.write_event(Event("synthesize", {"text": body["text"], "chattts": body["chattts"]}))
        while (event := await client.read_event()) is not None:
            nbytes += len(json.dumps(event.data or {})) + len(event.payload or b"")
            if AudioChunk.is_type(event.type):
                samples += len(event.payload or b"") // 2
            elif AudioStop.is_type(event.type) or event.type == "error":
                break
    return samples / SAMPLE_RATE, nbytes


def measure(base: str, pid: int, wyoming_port: int, limit_s: float, cfg: ServerConfig) -> dict[str, dict]:
    out = {}
    probe = LoopProbe(base, pid)
    try:
        with httpx.Client(base_url=base, timeout=max(120, limit_s * 4)) as c:
            for route, requests in worst_requests(limit_s, cfg).items():
                for kind, body in requests:
                    probe.reset()
                    model0 = _model_seconds(base)
                    if kind == "ws":
                        audio, nbytes = asyncio.run(_ws(base, dict(body)))
                        status = 200
                    elif kind == "wyoming":
                        audio, nbytes = asyncio.run(_wyoming(wyoming_port, body))
                        status = 200
                    else:
                        path = route.split(" ")[0]
                        r = c.post(path, json=body)
                        status = r.status_code
                        if status != 200:
                            raise RuntimeError(f"{route} ({kind}): {status} {r.text[:300]}")
                        audio, nbytes = _audio_of(kind, body, r)
                    time.sleep(0.05)
                    model = _model_seconds(base) - model0
                    row = {
                        "audio_s": round(audio, 2),
                        "bytes": nbytes,
                        "steps": round(model * TOKENS_PER_SECOND),
                        "loop_ms": round(probe.worst_ms, 1),
                        "rss_mb": round(probe.rss_mb, 1),
                        "request_bytes": len(json.dumps(body).encode()),
                        "kind": kind,
                    }
                    prev = out.get(route)
                    if prev is None or row["bytes"] > prev["bytes"]:
                        out[route] = row
    finally:
        probe.stop()
    return out


def _serve(ckpt: Path, tmp: Path, limit_s: float) -> tuple[subprocess.Popen, str, int]:
    from chattts_serve.bench.common import wait_ready

    port, wy = _free_port(), _free_port()
    cmd = [
        sys.executable, "-m", "chattts_serve.cli", "serve", "--model", str(ckpt), "--host", "127.0.0.1",
        "--port", str(port), "--voices-db", str(tmp / "voices.sqlite3"), "--cache-mb", "0",
        "--threads", "1", "--log-level", "warning", "--max-audio-seconds", str(limit_s),
        "--wyoming-uri", f"tcp://127.0.0.1:{wy}",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(tmp / "server.log", "w"))  # noqa: SIM115
    base = f"http://127.0.0.1:{port}"
    wait_ready(base, proc, timeout=180)
    return proc, base, wy


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def table(rows: list[Row], limit_s: float) -> str:
    lines = [
        "| Route | Worst request tried | Audio s (bound / measured) | Response bytes (bound / measured) "
        "| Engine steps (bound / measured) | Event-loop lag, ms | Server RSS growth, MB |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        m = r.measured
        lines.append(
            f"| `{r.route}` | {r.worst} | {r.audio_s:,.0f} / {m.get('audio_s', '-')} | {r.bytes:,} / "
            f"{m.get('bytes', 0):,} | {r.steps:,} / {m.get('steps', '-')} | {m.get('loop_ms', '-')} "
            f"| {m.get('rss_mb', '-')} |"
        )
    return (
        "\n".join(lines)
        + f"\n\n(L = max_audio_seconds = {limit_s:g} s; formulas: "
        + "; ".join(f"{r.route}: {r.formula}" for r in rows)
        + ")"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint (default: the tiny random one, written to a temporary folder)")
    ap.add_argument("--quick", action="store_true", help="max_audio_seconds 10 instead of the default")
    ap.add_argument("--max-audio-seconds", type=float, default=None)
    ap.add_argument("--markdown", action="store_true", help="print the table, not JSON")
    args = ap.parse_args(argv)
    cfg = ServerConfig()
    limit_s = args.max_audio_seconds or (10.0 if args.quick else cfg.engine.max_audio_seconds)
    rows = bounds(limit_s, cfg)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        ckpt = args.model
        if ckpt is None:
            from chattts_serve.models.chattts.random_checkpoint import write_random

            ckpt = write_random(tmp / "tiny", "tiny", seed=0)
        proc, base, wy = _serve(Path(ckpt), tmp, limit_s)
        try:
            measured = measure(base, proc.pid, wy, limit_s, cfg)
        finally:
            proc.terminate()
            proc.wait(30)
    over = []
    for r in rows:
        r.measured = measured.get(r.route, {})
        m = r.measured
        if m and (m["audio_s"] > r.audio_s + 0.05 or m["bytes"] > r.bytes or m["steps"] > r.steps + 1):
            over.append(r.route)
    if args.markdown:
        print(table(rows, limit_s))
    else:
        doc = {"max_audio_seconds": limit_s, "max_body_bytes": cfg.max_body_bytes, "over": over}
        doc["routes"] = [{**r.__dict__} for r in rows]
        print(json.dumps(doc, ensure_ascii=False, indent=1))
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
