"""The load generator of ``bench serve``: one HTTP request timed chunk by chunk, and the two load shapes.

A request's stream is turned into ``(time, cumulative audio seconds)`` arrivals (``AudioCounter``), and those
into what a real-time player would have heard (``simulate_playback``). The load shapes only decide when each
request starts: ``closed_loop`` keeps at most ``level`` in flight, ``open_loop`` starts them at Poisson
``poisson_arrivals`` whatever is still running. Aggregating and reporting the results is ``serve``'s job.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import struct
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

SAMPLE_RATE = 24000
"""pcm responses are raw s16le mono at this rate."""
G711_RATE = 8000
"""mulaw and alaw responses are one byte per sample at this rate (no ``sample_rate`` is sent)."""
OPEN_LOOP_MAX_WORKERS = 256
"""Open-loop requests in flight at most; later arrivals wait client-side (and that wait counts as latency)."""
_EPS = 1e-9


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


COUNTED_FORMATS = ("pcm", "wav", "mulaw", "alaw")
"""The formats whose bytes ``AudioCounter`` turns into audio seconds."""


class AudioCounter:
    """Turns received bytes into audio seconds, per response format. pcm is 16-bit mono 24 kHz, mulaw and
    alaw (G.711) a byte per sample at 8 kHz; wav is counted past its header using the header's rate;
    compressed formats are not counted (None), since their bytes do not map linearly onto time."""

    def __init__(self, fmt: str) -> None:
        self.fmt = fmt
        self.received = 0
        self._head = b""
        self._wav: tuple[int, int, int] | None = None  # (data offset, block align, sample rate)

    @property
    def known(self) -> bool:
        return self.fmt in COUNTED_FORMATS

    def feed(self, chunk: bytes) -> float | None:
        """Add ``chunk``; returns the cumulative audio seconds so far (None for compressed formats)."""
        self.received += len(chunk)
        if self.fmt == "pcm":
            return (self.received // 2) / SAMPLE_RATE
        if self.fmt in ("mulaw", "alaw"):
            return self.received / G711_RATE
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


# --------------------------------------------------------------------------------------- load shapes


def closed_loop(
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


def open_loop(
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


def make_client(args: argparse.Namespace) -> Any:
    """The httpx client every request of a run shares: ``--url``, ``--api-key`` and ``--timeout``."""
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
