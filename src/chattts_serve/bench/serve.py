"""``chattts-serve bench serve``: an HTTP load generator for a running chattts-serve server.

It measures what a listener notices, not only what the server does: time to the first audio byte, total
latency, real-time factor, and whether a client that starts playing at the first byte would ever run dry
(an underrun). Two load shapes:

* closed loop, ``--concurrency 1,4,16``: a sweep; each level keeps at most ``level`` requests in flight;
* open loop, ``--rate 0.5,1``: Poisson arrivals (exponential gaps, ``--seed``), independent of how fast
  the server answers. Latency counts from the scheduled arrival, so client-side queueing is not hidden.

Prints one JSON line (see ``stats.emit``); ``--plot PATH`` writes TTFB and throughput per level as a PNG.

The requests themselves (timing, byte accounting, the playback model, the load shapes) are in ``serve_load``;
this module is the command: its flags, the per-level statistics, the JSON line and the plot.
"""

from __future__ import annotations

import argparse
import math
import random
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from . import stats
from .serve_load import (
    COUNTED_FORMATS,
    RequestResult,
    build_request,
    closed_loop,
    make_client,
    one_request,
    open_loop,
    poisson_arrivals,
)

DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_TEXT = "The quick brown fox jumps over the lazy dog, then naps in the warm afternoon sun."
FORMATS = ("pcm", "wav", "mp3", "opus", "aac", "flac", "mulaw", "alaw")
DEFAULT_RATE_REQUESTS = 20


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
        help="response format (default pcm); audio seconds, RTF and underruns need pcm, wav, mulaw or alaw",
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


# --------------------------------------------------------------------------------------------- run


def _read_texts(args: argparse.Namespace) -> list[str]:
    if args.texts_file:
        texts = [line.strip() for line in Path(args.texts_file).read_text("utf-8").splitlines() if line.strip()]
        if not texts:
            raise ValueError(f"{args.texts_file}: no non-empty lines")
        return texts
    return [args.text or DEFAULT_TEXT]


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
    if args.format not in COUNTED_FORMATS:
        notes.append(
            f"format {args.format}: compressed bytes do not map onto audio time, so audio seconds, RTF, "
            f"underruns and audio-s per s are not reported (use {', '.join(COUNTED_FORMATS)})"
        )
    levels: list[LevelResult] = []
    with make_client(args) as client:

        def send(i: int, t0: float) -> RequestResult:
            spec = build_request(args, texts[i % len(texts)], args.seed + i)
            return one_request(client, spec, i, t0, args.format, args.timeout, jitter_s)

        if args.rate:
            for k, rate in enumerate(args.rate):
                n = args.requests if args.requests is not None else (None if args.duration else DEFAULT_RATE_REQUESTS)
                arrivals = poisson_arrivals(rate, random.Random(args.seed + k), n, args.duration)
                results, wall = open_loop(send, arrivals)
                levels.append(summarize_level(results, wall, rate=rate))
        else:
            for level in args.concurrency or [1]:
                n = args.requests if args.requests is not None else 2 * level
                results, wall = closed_loop(send, level, n, args.duration)
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
