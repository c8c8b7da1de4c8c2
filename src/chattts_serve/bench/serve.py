"""``chattts-serve bench serve``: an HTTP load generator for a running chattts-serve server.

It measures what a listener notices, not only what the server does: time to the first audio byte, total
latency, real-time factor, and whether a client that starts playing at the first byte would ever run dry
(an underrun). Two load shapes:

* closed loop, ``--concurrency 1,4,16``: a sweep; each level keeps at most ``level`` requests in flight;
* open loop, ``--rate 0.5,1``: Poisson arrivals (exponential gaps, ``--seed``), independent of how fast
  the server answers. Latency counts from the scheduled arrival, so client-side queueing is not hidden.

Prints one JSON line (see ``stats.emit``); ``--plot PATH`` writes TTFB and throughput per level as a PNG.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import struct
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from . import stats

DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_TEXT = "The quick brown fox jumps over the lazy dog, then naps in the warm afternoon sun."
FORMATS = ("pcm", "wav", "mp3", "opus", "aac", "flac")
SAMPLE_RATE = 24000
"""pcm responses are raw s16le mono at this rate."""
OPEN_LOOP_MAX_WORKERS = 256
"""Open-loop requests in flight at most; later arrivals wait client-side (and that wait counts as latency)."""
DEFAULT_RATE_REQUESTS = 20
_EPS = 1e-9


# ----------------------------------------------------------------------------------------- arguments


def _positive_ints(value: str) -> list[int]:
    try:
        levels = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive ints, got {value!r}") from None
    if not levels or any(v < 1 for v in levels):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive ints, got {value!r}")
    return levels


def _positive_floats(value: str) -> list[float]:
    try:
        rates = [float(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive numbers, got {value!r}") from None
    if not rates or any(not (math.isfinite(v) and v > 0) for v in rates):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive numbers, got {value!r}")
    return rates


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``bench serve`` (the CLI wires a subparser to this, ``run`` and ``main``)."""
    parser.add_argument("--url", default=DEFAULT_URL, help=f"server base URL (default {DEFAULT_URL})")
    parser.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument(
        "--endpoint",
        choices=("openai", "native"),
        default="openai",
        help="openai: POST /v1/audio/speech; native: POST /v1/tts with stream=true (default openai)",
    )
    texts = parser.add_mutually_exclusive_group()
    texts.add_argument("--text", default=None, help="text of every request (default: one English sentence)")
    texts.add_argument("--texts-file", default=None, help="UTF-8 file, one text per line; requests cycle through it")
    parser.add_argument("--voice", default=None, help="voice name or speaker string (openai default: alloy)")
    parser.add_argument(
        "--steps",
        type=int,
        default=0,
        help="audio tokens per request (min_new_tokens = max_new_tokens), so every request has the same "
        "length; 0 lets the model decide (default 0)",
    )
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default="pcm",
        help="response format (default pcm); audio seconds, RTF and underruns need pcm or wav",
    )
    parser.add_argument("--refine-text", action="store_true", help="run ChatTTS's text refinement first")
    load = parser.add_mutually_exclusive_group()
    load.add_argument(
        "--concurrency",
        type=_positive_ints,
        default=None,
        help="closed-loop sweep, e.g. 1,4,16: at most LEVEL requests in flight per level (default 1)",
    )
    load.add_argument(
        "--rate", type=_positive_floats, default=None, help="open loop: Poisson arrivals per second, e.g. 0.5,1,2"
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=None,
        help=f"requests per level (default: 2 x concurrency; with --rate {DEFAULT_RATE_REQUESTS}, or unbounded "
        "when --duration is set)",
    )
    parser.add_argument("--duration", type=float, default=None, help="per level: start no request after this (s)")
    parser.add_argument("--seed", type=int, default=0, help="request i uses seed+i; also seeds the arrivals")
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request limit in seconds (default 600)")
    parser.add_argument(
        "--jitter-ms",
        type=float,
        default=0.0,
        help="playback starts this long after the first audio byte (a jitter buffer) when counting underruns",
    )
    parser.add_argument("--plot", default=None, metavar="PATH", help="write TTFB and throughput per level as PNG")


# --------------------------------------------------------------------------------- playback model


@dataclass(frozen=True)
class Playback:
    """What a real-time player would have experienced on one stream."""

    stalls: int
    """Separate times the player ran out of audio (each resumes when more arrives)."""
    stall_s: float
    """Total time spent waiting for audio after playback started."""

    @property
    def kept_up(self) -> bool:
        return self.stalls == 0


def simulate_playback(arrivals: Sequence[tuple[float, float]], start_delay_s: float = 0.0) -> Playback:
    """Play a stream in real time and count underruns.

    ``arrivals`` are ``(time_s, cumulative audio seconds received)`` in arrival order. Playback starts at the
    first arrival that carries audio, plus ``start_delay_s``; it advances at wall-clock speed while audio is
    buffered, and when the buffer runs dry it stalls until the next arrival, then resumes. With no delay a
    stall happens exactly when the audio received so far is less than the wall time since the first byte."""
    start_i = next((i for i, (_, a) in enumerate(arrivals) if a > _EPS), None)
    if start_i is None:
        return Playback(0, 0.0)
    clock = arrivals[start_i][0] + start_delay_s
    have = max(a for t, a in arrivals[: start_i + 1])
    pos, stalls, stall_s, stalled = 0.0, 0, 0.0, False
    for t, audio in arrivals[start_i + 1 :]:
        if t <= clock:  # arrived during the start delay: just buffered
            have = max(have, audio)
            continue
        room, dt = have - pos, t - clock
        if dt > room + _EPS:
            if room > _EPS or not stalled:
                stalls += 1
            stalled = True
            stall_s += dt - room
            pos = have
        else:
            pos += dt
            stalled = False
        clock, have = t, max(have, audio)
    return Playback(stalls, stall_s)


# ------------------------------------------------------------------------------------- audio bytes


class AudioCounter:
    """Turns received bytes into audio seconds, per response format. pcm is 16-bit mono 24 kHz; wav is
    counted past its header using the header's rate; compressed formats are not counted (None), since
    their bytes do not map linearly onto time."""

    def __init__(self, fmt: str) -> None:
        self.fmt = fmt
        self.received = 0
        self._head = b""
        self._wav: tuple[int, int, int] | None = None  # (data offset, block align, sample rate)

    @property
    def known(self) -> bool:
        return self.fmt in ("pcm", "wav")

    def feed(self, chunk: bytes) -> float | None:
        """Add ``chunk``; returns the cumulative audio seconds so far (None for compressed formats)."""
        self.received += len(chunk)
        if self.fmt == "pcm":
            return (self.received // 2) / SAMPLE_RATE
        if self.fmt != "wav":
            return None
        if self._wav is None:
            self._head += chunk
            self._wav = parse_wav_header(self._head)
            if self._wav is None:
                return 0.0
            self._head = b""
        offset, align, rate = self._wav
        return (max(0, self.received - offset) // align) / rate


def parse_wav_header(head: bytes) -> tuple[int, int, int] | None:
    """(data offset, block align, sample rate) of a RIFF/WAVE prefix; None while the header is incomplete.
    Streamed wav has open-ended sizes (0xFFFFFFFF), so only the chunk layout is trusted, not the sizes."""
    if len(head) < 12:
        return None
    if head[:4] != b"RIFF" or head[8:12] != b"WAVE":
        raise ValueError("response is not a RIFF/WAVE stream")
    pos, fmt = 12, None
    while len(head) >= pos + 8:
        chunk_id, size = head[pos : pos + 4], struct.unpack_from("<I", head, pos + 4)[0]
        if chunk_id == b"data":
            if fmt is None:
                raise ValueError("wav data chunk before its fmt chunk")
            return pos + 8, fmt[0], fmt[1]
        if chunk_id == b"fmt ":
            if len(head) < pos + 8 + 16:
                return None
            _, _, rate, _, align = struct.unpack_from("<HHIIH", head, pos + 8)
            if rate == 0 or align == 0:
                raise ValueError("wav fmt chunk with zero rate or block align")
            fmt = (align, rate)
        pos += 8 + size + (size & 1)
    return None


# ---------------------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class RequestSpec:
    path: str
    body: dict[str, Any]


def build_request(args: argparse.Namespace, text: str, seed: int) -> RequestSpec:
    """The JSON body for one request on the chosen endpoint. Both endpoints take the ChatTTS sampling fields
    at the top level (the native schema ``TTSRequest`` is flat: there is no nested params object)."""
    fixed: dict[str, Any] = {"seed": seed, "refine_text": bool(args.refine_text)}
    if args.steps > 0:
        fixed.update(min_new_tokens=args.steps, max_new_tokens=args.steps)
    if args.endpoint == "openai":
        body = {"model": "tts-1", "input": text, "voice": args.voice or "alloy", "response_format": args.format}
        return RequestSpec("/v1/audio/speech", {**body, **fixed})
    body = {"text": text, "format": args.format, "stream": True}
    if args.voice:
        body["voice"] = args.voice
    return RequestSpec("/v1/tts", {**body, **fixed})


@dataclass
class RequestResult:
    """One request as the client saw it; times are seconds from the request's (scheduled) start."""

    index: int
    ok: bool = False
    status: int | None = None
    error: str | None = None
    ttfb_s: float | None = None
    """Time to the first audio byte (for compressed formats: the first byte)."""
    last_byte_s: float | None = None
    latency_s: float | None = None
    bytes: int = 0
    audio_s: float | None = None
    playback: Playback | None = None

    @property
    def rtf(self) -> float | None:
        """Wall time from the request's start to its end, per second of audio (< 1: faster than real time)."""
        if self.latency_s is None or not self.audio_s:
            return None
        return self.latency_s / self.audio_s

    @property
    def rtf_from_first_byte(self) -> float | None:
        """Generation time after the first audio byte per second of audio: > 1 means the stream cannot keep
        up with playback once it has started, however long the client buffers."""
        if self.ttfb_s is None or self.last_byte_s is None or not self.audio_s:
            return None
        return (self.last_byte_s - self.ttfb_s) / self.audio_s


def _error_message(status: int, body: bytes) -> str:
    """``HTTP 401: <message>``, taking the message from the server's OpenAI-shaped error JSON if present."""
    text = body.decode("utf-8", errors="replace")
    try:
        err = json.loads(text).get("error", {})
        message = err.get("message") if isinstance(err, dict) else None
    except (ValueError, AttributeError):
        message = None
    return f"HTTP {status}: {(message or text).strip()[:300]}"


def one_request(
    client: Any, spec: RequestSpec, index: int, t0: float, fmt: str, timeout_s: float, jitter_s: float
) -> RequestResult:
    """Send one request and read its stream, timing every chunk from ``t0`` (a ``time.perf_counter`` value).
    A failure of any kind is recorded in the result rather than raised: under load, errors are data."""
    res = RequestResult(index)
    counter = AudioCounter(fmt)
    arrivals: list[tuple[float, float]] = []
    try:
        with client.stream("POST", spec.path, json=spec.body) as resp:
            res.status = resp.status_code
            if resp.status_code != 200:
                res.error = _error_message(resp.status_code, resp.read()[:4096])
                return res
            for chunk in resp.iter_bytes():
                now = time.perf_counter() - t0
                if now > timeout_s:
                    raise TimeoutError(f"stream still running after {timeout_s:g} s")
                if not chunk:
                    continue
                audio = counter.feed(chunk)
                if res.ttfb_s is None and (audio is None or audio > 0):
                    res.ttfb_s = now
                res.last_byte_s = now
                if audio is not None:
                    arrivals.append((now, audio))
        res.latency_s = time.perf_counter() - t0
    except Exception as exc:  # a failed request is a measurement, never a crash
        res.error = f"{type(exc).__name__}: {exc}"[:300]
        return res
    finally:
        res.bytes = counter.received
    if counter.known:
        res.audio_s = arrivals[-1][1] if arrivals else 0.0
        res.playback = simulate_playback(arrivals, jitter_s)
    if res.ttfb_s is None:
        res.error = "empty response: no audio received"
        return res
    res.ok = True
    return res


# ------------------------------------------------------------------------------------------ levels


@dataclass
class LevelResult:
    """One load level (a concurrency or a rate): the per-request distributions and the aggregates."""

    concurrency: int | None
    rate: float | None
    n: int
    ok: int
    errors: int
    first_error: str | None
    error_kinds: dict[str, int]
    wall_s: float
    ttfb_s: dict[str, Any]
    latency_s: dict[str, Any]
    rtf: dict[str, Any]
    rtf_from_first_byte: dict[str, Any]
    audio_s: dict[str, Any]
    stall_s: dict[str, Any]
    underrun_streams: int | None
    underrun_fraction: float | None
    audio_s_per_s: float | None
    requests_per_s: float


def _values(results: Iterable[RequestResult], get: Callable[[RequestResult], float | None]) -> list[float]:
    return [v for v in map(get, results) if v is not None]


def _error_kind(r: RequestResult) -> str:
    if r.status is not None and r.status != 200:
        return str(r.status)
    return (r.error or "error").split(":", 1)[0]


def summarize_level(
    results: Sequence[RequestResult], wall_s: float, *, concurrency: int | None = None, rate: float | None = None
) -> LevelResult:
    """Aggregate one level. Latency, RTF and underruns only count successful streams; throughput is audio
    seconds received per wall second over the whole level."""
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    played = [r for r in ok if r.playback is not None]
    underruns = sum(1 for r in played if not r.playback.kept_up)
    audio = _values(ok, lambda r: r.audio_s)
    known_audio = bool(played)
    return LevelResult(
        concurrency=concurrency,
        rate=rate,
        n=len(results),
        ok=len(ok),
        errors=len(failed),
        first_error=min(failed, key=lambda r: r.index).error if failed else None,
        error_kinds=dict(Counter(_error_kind(r) for r in failed)),
        wall_s=wall_s,
        ttfb_s=stats.summarize(_values(ok, lambda r: r.ttfb_s)),
        latency_s=stats.summarize(_values(ok, lambda r: r.latency_s)),
        rtf=stats.summarize(_values(ok, lambda r: r.rtf)),
        rtf_from_first_byte=stats.summarize(_values(ok, lambda r: r.rtf_from_first_byte)),
        audio_s=stats.summarize(audio),
        stall_s=stats.summarize([r.playback.stall_s for r in played]),
        underrun_streams=underruns if known_audio else None,
        underrun_fraction=underruns / len(played) if known_audio else None,
        audio_s_per_s=sum(audio) / wall_s if known_audio and wall_s > 0 else None,
        requests_per_s=len(ok) / wall_s if wall_s > 0 else 0.0,
    )


def _read_texts(args: argparse.Namespace) -> list[str]:
    if args.texts_file:
        texts = [line.strip() for line in Path(args.texts_file).read_text("utf-8").splitlines() if line.strip()]
        if not texts:
            raise ValueError(f"{args.texts_file}: no non-empty lines")
        return texts
    return [args.text or DEFAULT_TEXT]


def _closed_loop(
    send: Callable[[int, float], RequestResult], level: int, n: int, duration: float | None
) -> tuple[list[RequestResult], float]:
    """``n`` requests, at most ``level`` in flight; a freed slot starts the next one at once."""
    start = time.perf_counter()
    deadline = start + duration if duration else math.inf

    def task(i: int) -> RequestResult | None:
        now = time.perf_counter()
        return None if now > deadline else send(i, now)

    with ThreadPoolExecutor(max_workers=level, thread_name_prefix="bench") as pool:
        futures = [pool.submit(task, i) for i in range(n)]
        results = [r for r in (f.result() for f in futures) if r is not None]
    return results, time.perf_counter() - start


def poisson_arrivals(rate: float, rng: random.Random, n: int | None, duration: float | None) -> list[float]:
    """Arrival times (s from the level's start) of a Poisson process: exponential gaps with mean 1/rate,
    stopping after ``n`` arrivals or past ``duration``, whichever comes first."""
    if n is None and duration is None:
        raise ValueError("poisson_arrivals needs n or duration")
    times, t = [], 0.0
    while n is None or len(times) < n:
        t += rng.expovariate(rate)
        if duration is not None and t > duration:
            break
        times.append(t)
    return times


def _open_loop(
    send: Callable[[int, float], RequestResult], arrivals: Sequence[float]
) -> tuple[list[RequestResult], float]:
    """Start request i at ``arrivals[i]`` whatever is still in flight; each is timed from its scheduled
    arrival, so a late start (the client's own worker cap) shows up as latency instead of vanishing."""
    workers = max(1, min(len(arrivals), OPEN_LOOP_MAX_WORKERS))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="bench") as pool:
        start = time.perf_counter()
        futures = []
        for i, at in enumerate(arrivals):
            delay = start + at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            futures.append(pool.submit(send, i, start + at))
        results = [f.result() for f in futures]
    return results, time.perf_counter() - start


def _client(args: argparse.Namespace) -> Any:
    try:
        import httpx
    except ImportError as exc:  # httpx is in the bench/test extras, not a core dependency
        raise RuntimeError(
            "bench serve needs httpx: pip install httpx (or pip install 'chattts-serve[bench]')"
        ) from exc
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    # trust_env=False: a load generator must hit the server directly, never through a proxy from the environment.
    return httpx.Client(
        base_url=args.url.rstrip("/"),
        headers=headers,
        timeout=httpx.Timeout(args.timeout),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        trust_env=False,
    )


def _validate(args: argparse.Namespace) -> None:
    if args.steps < 0:
        raise ValueError(f"--steps must be >= 0, got {args.steps}")
    if args.requests is not None and args.requests < 1:
        raise ValueError(f"--requests must be >= 1, got {args.requests}")
    if args.duration is not None and not args.duration > 0:
        raise ValueError(f"--duration must be > 0, got {args.duration}")
    if not args.timeout > 0:
        raise ValueError(f"--timeout must be > 0, got {args.timeout}")
    if args.jitter_ms < 0:
        raise ValueError(f"--jitter-ms must be >= 0, got {args.jitter_ms}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run every load level in turn against ``args.url``; returns the result dict (not yet printed)."""
    _validate(args)
    texts = _read_texts(args)
    jitter_s = args.jitter_ms / 1000
    notes: list[str] = []
    if args.format not in ("pcm", "wav"):
        notes.append(
            f"format {args.format}: compressed bytes do not map onto audio time, so audio seconds, RTF, "
            "underruns and audio-s per s are not reported (use pcm or wav)"
        )
    levels: list[LevelResult] = []
    with _client(args) as client:

        def send(i: int, t0: float) -> RequestResult:
            spec = build_request(args, texts[i % len(texts)], args.seed + i)
            return one_request(client, spec, i, t0, args.format, args.timeout, jitter_s)

        if args.rate:
            for k, rate in enumerate(args.rate):
                n = args.requests if args.requests is not None else (None if args.duration else DEFAULT_RATE_REQUESTS)
                arrivals = poisson_arrivals(rate, random.Random(args.seed + k), n, args.duration)
                results, wall = _open_loop(send, arrivals)
                levels.append(summarize_level(results, wall, rate=rate))
        else:
            for level in args.concurrency or [1]:
                n = args.requests if args.requests is not None else 2 * level
                results, wall = _closed_loop(send, level, n, args.duration)
                levels.append(summarize_level(results, wall, concurrency=level))
    return {
        "bench": "serve",
        "url": args.url,
        "endpoint": args.endpoint,
        "format": args.format,
        "steps": args.steps,
        "mode": "rate" if args.rate else "concurrency",
        "jitter_ms": args.jitter_ms,
        "texts": len(texts),
        "levels": [_rounded(asdict(lv)) for lv in levels],
        "notes": notes,
    }


def _rounded(value: Any, digits: int = 4) -> Any:
    if isinstance(value, float):
        return round(value, digits)
    if isinstance(value, dict):
        return {k: _rounded(v, digits) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v, digits) for v in value]
    return value


def plot(result: dict[str, Any], path: str | Path) -> Path:
    """TTFB p50/p99 and aggregate throughput against the load levels of ``result``."""
    by_rate = result["mode"] == "rate"
    levels = result["levels"]
    x = [lv["rate"] if by_rate else lv["concurrency"] for lv in levels]
    panels = [
        stats.Panel(
            "TTFB (s)", {"p50": [lv["ttfb_s"]["p50"] for lv in levels], "p99": [lv["ttfb_s"]["p99"] for lv in levels]}
        ),
        stats.Panel("audio-s per s", {"throughput": [lv["audio_s_per_s"] for lv in levels]}),
    ]
    spread = max(x) / min(x) if x else 1
    return stats.save_plot(
        path,
        x,
        panels,
        xlabel="arrival rate (requests/s)" if by_rate else "concurrency (requests in flight)",
        title=f"bench serve: {result['endpoint']} {result['format']}, steps={result['steps']}",
        logx=spread >= 8,
    )


def main(args: argparse.Namespace) -> int:
    """Run, write the plot if asked, print the JSON line. Exit status 1 when any request failed, so scripts
    notice; the line is printed either way."""
    if args.plot:
        stats.require_matplotlib()  # fail before the benchmark, not after it
    result = run(args)
    if args.plot:
        result["plot"] = str(plot(result, args.plot))
    stats.emit(result)
    return 1 if any(lv["errors"] for lv in result["levels"]) else 0
