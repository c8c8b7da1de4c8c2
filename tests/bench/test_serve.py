"""``bench serve``: the playback (underrun) model and byte accounting as pure functions, then end to end
against a real server process on the tiny random checkpoint."""

from __future__ import annotations

import argparse
import json
import random
import struct

import pytest

from chattts_serve.bench import serve, serve_load
from chattts_serve.bench.serve_load import AudioCounter, Playback, RequestResult, simulate_playback

from ..server.conftest import running_server

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SR = 24000
KEY = "bench-key"
STEPS = 8
EXPECTED_S = (512 * STEPS - 256) / SR  # one text segment of STEPS audio tokens
TOKEN_S = 512 / SR


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    return p.parse_args(list(argv))


# ----------------------------------------------------------------------------------- playback model


def test_stream_that_keeps_ahead_has_no_underrun():
    # 1 s of audio every 0.5 s: the buffer only grows
    arrivals = [(0.3 + 0.5 * i, 1.0 * (i + 1)) for i in range(6)]
    assert simulate_playback(arrivals) == Playback(0, 0.0)
    assert simulate_playback(arrivals).kept_up


def test_stream_that_falls_behind_underruns():
    # 0.1 s of audio every 0.2 s: runs dry 0.1 s before each new chunk
    arrivals = [(0.0, 0.1), (0.2, 0.2), (0.4, 0.3)]
    pb = simulate_playback(arrivals)
    assert pb.stalls == 2 and not pb.kept_up
    assert pb.stall_s == pytest.approx(0.2)


def test_exactly_real_time_is_not_an_underrun():
    arrivals = [(1.0 + 0.1 * i, 0.1 * (i + 1)) for i in range(20)]
    assert simulate_playback(arrivals).stalls == 0


def test_start_delay_absorbs_jitter():
    arrivals = [(0.0, 0.1), (0.2, 0.2), (0.4, 0.3)]
    pb = simulate_playback(arrivals, start_delay_s=0.15)
    assert pb.stalls == 1 and pb.stall_s == pytest.approx(0.05)
    assert simulate_playback(arrivals, start_delay_s=0.2).stalls == 0


def test_one_long_gap_is_one_stall_even_across_empty_arrivals():
    # a chunk with no new audio (e.g. an odd byte) does not end the stall or start a second one
    arrivals = [(0.0, 0.1), (0.5, 0.1), (1.0, 2.0)]
    pb = simulate_playback(arrivals)
    assert pb.stalls == 1 and pb.stall_s == pytest.approx(0.9)


def test_playback_starts_at_first_audio_not_first_byte():
    # a wav header (no audio) arrives long before the first samples
    arrivals = [(0.0, 0.0), (2.0, 0.5), (2.4, 1.0)]
    assert simulate_playback(arrivals).stalls == 0
    assert simulate_playback([]) == Playback(0, 0.0)
    assert simulate_playback([(0.1, 0.0)]) == Playback(0, 0.0)


def test_stall_time_is_the_largest_deficit():
    """With no start delay, total stall time equals the largest (elapsed since first byte - audio received)."""
    rng = random.Random(5)
    for _ in range(200):
        t, audio, arrivals = 0.0, 0.0, []
        for _ in range(rng.randint(1, 30)):
            t += rng.uniform(0.0, 0.3)
            audio += rng.choice([0.0, rng.uniform(0.0, 0.3)])
            arrivals.append((t, audio))
        first = next((i for i, (_, a) in enumerate(arrivals) if a > 0), None)
        pb = simulate_playback(arrivals)
        if first is None:
            assert pb == Playback(0, 0.0)
            continue
        t0 = arrivals[first][0]
        deficit = max([0.0] + [ti - t0 - arrivals[i - 1][1] for i, (ti, _) in enumerate(arrivals) if i > first])
        assert pb.stall_s == pytest.approx(deficit, abs=1e-9)
        assert (pb.stalls > 0) == (deficit > 1e-9)


# ------------------------------------------------------------------------------------- byte counting


def test_pcm_counter_counts_whole_samples():
    c = AudioCounter("pcm")
    assert c.feed(b"\0" * 3) == pytest.approx(1 / SR)  # an odd byte is half a sample: not counted yet
    assert c.feed(b"\0" * (2 * SR - 3)) == pytest.approx(1.0)
    assert c.received == 2 * SR


def test_wav_counter_skips_a_header_split_across_chunks():
    header = (
        b"RIFF" + struct.pack("<I", 0xFFFFFFFF) + b"WAVEfmt " + struct.pack("<IHHIIHH", 16, 1, 1, SR, 2 * SR, 2, 16)
    )
    header += b"data" + struct.pack("<I", 0xFFFFFFFF)
    c = AudioCounter("wav")
    assert c.feed(header[:10]) == 0.0
    assert c.feed(header[10:30]) == 0.0
    assert c.feed(header[30:] + b"\0" * 2 * SR) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        AudioCounter("wav").feed(b"ID3" + b"\0" * 40)
    assert AudioCounter("mp3").feed(b"\xff" * 100) is None


def test_g711_is_a_byte_per_sample_at_8khz():
    for fmt in ("mulaw", "alaw"):
        c = AudioCounter(fmt)
        assert c.known and c.feed(b"\xff" * 4000) == pytest.approx(0.5) and c.feed(b"\xff" * 4000) == 1.0


# ----------------------------------------------------------------------------------- request bodies


@pytest.mark.parametrize("endpoint", ["openai", "native"])
def test_request_bodies_match_the_server_schema(endpoint):
    from chattts_serve.server.protocol import SpeechRequest, TTSRequest

    args = parse("--endpoint", endpoint, "--steps", "12", "--format", "wav")
    spec = serve_load.build_request(args, "Hello there.", 7)
    model = SpeechRequest if endpoint == "openai" else TTSRequest
    req = model(**spec.body)  # strict, extra="forbid": a misspelt or misplaced field fails here
    assert spec.path == ("/v1/audio/speech" if endpoint == "openai" else "/v1/tts")
    assert (req.seed, req.min_new_tokens, req.max_new_tokens, req.refine_text) == (7, 12, 12, False)
    if endpoint == "native":
        assert req.stream is True and req.format == "wav"
    else:
        assert req.response_format == "wav" and req.input == "Hello there."
    free = serve_load.build_request(parse("--endpoint", endpoint), "x", 0).body
    assert "min_new_tokens" not in free and "max_new_tokens" not in free


def test_bad_flags_are_rejected():
    for argv in (
        ["--concurrency", "1,0"],
        ["--concurrency", "a"],
        ["--rate", "-1"],
        ["--concurrency", "1", "--rate", "1"],
    ):
        with pytest.raises(SystemExit):
            parse(*argv)
    with pytest.raises(ValueError, match="--steps"):
        serve.run(parse("--steps", "-1"))


def test_poisson_arrivals():
    a = serve_load.poisson_arrivals(4.0, random.Random(3), 2000, None)
    assert a == serve_load.poisson_arrivals(4.0, random.Random(3), 2000, None)  # reproducible from --seed
    assert len(a) == 2000 and all(x < y for x, y in zip(a, a[1:], strict=False))
    assert a[-1] / len(a) == pytest.approx(0.25, rel=0.1)  # mean gap 1/rate
    capped = serve_load.poisson_arrivals(4.0, random.Random(3), None, 5.0)
    assert capped and capped[-1] <= 5.0 and capped == [x for x in a if x <= 5.0]


def test_summarize_level():
    good = RequestResult(0, ok=True, status=200, ttfb_s=0.5, last_byte_s=1.5, latency_s=1.5, audio_s=2.0)
    good.playback = Playback(0, 0.0)
    slow = RequestResult(1, ok=True, status=200, ttfb_s=1.0, last_byte_s=4.0, latency_s=4.0, audio_s=2.0)
    slow.playback = Playback(2, 1.0)
    bad = RequestResult(2, status=429, error="HTTP 429: busy")
    lv = serve.summarize_level([good, slow, bad], 4.0, concurrency=3)
    assert (lv.n, lv.ok, lv.errors, lv.first_error, lv.error_kinds) == (3, 2, 1, "HTTP 429: busy", {"429": 1})
    assert lv.underrun_streams == 1 and lv.underrun_fraction == pytest.approx(0.5)
    assert lv.audio_s_per_s == pytest.approx(1.0) and lv.requests_per_s == pytest.approx(0.5)
    assert lv.rtf["max"] == pytest.approx(2.0) and lv.rtf_from_first_byte["max"] == pytest.approx(1.5)
    assert lv.ttfb_s["p50"] == pytest.approx(0.75)


# ---------------------------------------------------------------------------------- against a server


@pytest.fixture(scope="module")
def keyed_server(tiny_ckpt, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench-server")
    with running_server(tiny_ckpt, tmp, "--api-keys", KEY, "--max-num-seqs", "4", "--no-warmup") as base:
        yield base


def run_main(capsys, *argv: str) -> tuple[int, dict]:
    rc = serve.main(parse(*argv))
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1, lines
    return rc, json.loads(lines[0])


def check_audio_level(lv: dict) -> None:
    assert lv["errors"] == 0 and lv["first_error"] is None, lv
    assert lv["ok"] == lv["n"]
    assert 0 < lv["ttfb_s"]["min"] <= lv["ttfb_s"]["max"] <= lv["latency_s"]["max"]
    assert lv["audio_s"]["n"] == lv["n"]
    assert EXPECTED_S - TOKEN_S <= lv["audio_s"]["min"] <= lv["audio_s"]["max"] <= EXPECTED_S + TOKEN_S
    assert lv["rtf"]["p50"] > 0 and lv["rtf"]["max"] >= lv["rtf"]["p99"] >= lv["rtf"]["p50"]
    assert lv["underrun_streams"] is not None and 0 <= lv["underrun_fraction"] <= 1
    assert lv["audio_s_per_s"] > 0 and lv["requests_per_s"] > 0


def test_concurrency_sweep(keyed_server, capsys, tmp_path):
    png = tmp_path / "sweep.png"
    argv = ["--url", keyed_server, "--api-key", KEY, "--concurrency", "1,2", "--steps", str(STEPS)]
    rc, out = run_main(capsys, *argv, "--requests", "2", "--plot", str(png), "--timeout", "60")
    assert rc == 0
    assert (out["bench"], out["url"], out["endpoint"], out["mode"]) == ("serve", keyed_server, "openai", "concurrency")
    assert out["date"] and out["host"] and out["torch"]
    assert [lv["concurrency"] for lv in out["levels"]] == [1, 2]
    for lv in out["levels"]:
        assert lv["n"] == 2
        check_audio_level(lv)
    assert out["plot"] == str(png) and png.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize("fmt", ["wav", "mulaw"])
def test_native_endpoint_counted_formats(keyed_server, capsys, fmt):
    argv = ["--url", keyed_server, "--api-key", KEY, "--endpoint", "native", "--format", fmt, "--steps", str(STEPS)]
    rc, out = run_main(capsys, *argv, "--requests", "1", "--timeout", "60")
    assert rc == 0 and out["endpoint"] == "native" and out["notes"] == []
    check_audio_level(out["levels"][0])


def test_wrong_api_key_reports_errors(keyed_server, capsys):
    argv = ["--url", keyed_server, "--api-key", "wrong", "--concurrency", "1,2", "--steps", str(STEPS)]
    rc, out = run_main(capsys, *argv, "--timeout", "60")
    assert rc == 1
    assert [lv["n"] for lv in out["levels"]] == [2, 4]  # default: 2 x concurrency requests
    for lv in out["levels"]:
        assert lv["errors"] == lv["n"] and lv["ok"] == 0
        assert lv["first_error"].startswith("HTTP 401") and lv["error_kinds"] == {"401": lv["n"]}
        assert lv["ttfb_s"]["n"] == 0 and lv["audio_s_per_s"] is None


def test_unreachable_server_reports_errors(capsys, tmp_path):
    from ..server.conftest import free_port

    rc, out = run_main(capsys, "--url", f"http://127.0.0.1:{free_port()}", "--requests", "1", "--timeout", "5")
    assert rc == 1 and out["levels"][0]["errors"] == 1
    assert "Connect" in out["levels"][0]["first_error"]


def test_poisson_rate(keyed_server, capsys):
    argv = ["--url", keyed_server, "--api-key", KEY, "--rate", "4", "--requests", "3", "--steps", str(STEPS)]
    rc, out = run_main(capsys, *argv, "--seed", "1", "--timeout", "60")
    assert rc == 0 and out["mode"] == "rate"
    (lv,) = out["levels"]
    assert lv["rate"] == 4 and lv["concurrency"] is None and lv["n"] == 3
    check_audio_level(lv)
