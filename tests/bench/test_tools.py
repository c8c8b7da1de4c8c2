"""The in-process bench tools (``bench offline``, ``bench streams``, ``profile``, ``eval``) through the
real CLI on the tiny checkpoint: each prints one parseable JSON line whose numbers hang together, and
bad flags fail cleanly. Speed itself is not checked here (benchmarks live apart from tests)."""

from __future__ import annotations

import json
import os

import pytest

from chattts_serve.cli import main
from chattts_serve.engine.config import EngineConfig

pytestmark = pytest.mark.timeout(300)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_cli(capsys, *argv: str) -> dict:
    assert main(list(argv)) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return json.loads(lines[0])


def test_bench_offline(tiny_ckpt, tmp_path, capsys):
    plot = tmp_path / "offline.png"
    r = run_cli(
        capsys,
        "bench",
        "offline",
        "--model",
        str(tiny_ckpt),
        "--threads",
        "1",
        "--num-texts",
        "3",
        "--steps",
        "12",
        "--max-num-seqs",
        "2",
        "--precision",
        "int8-static",
        "--plot",
        str(plot),
    )
    assert r["bench"] == "offline" and r["precision"] == "int8-static" and r["num_texts"] == 3
    assert r["audio_s"] == pytest.approx(3 * (512 * 12 - 256) / 24000, abs=0.01)
    assert r["audio_s_per_s"] == pytest.approx(r["audio_s"] / r["wall_s"], rel=0.01)
    assert r["decode_steps_per_s"] == pytest.approx(36 / r["wall_s"], rel=0.01)
    lat = r["latency_s"]
    assert lat["n"] == 3 and 0 < lat["p50"] <= lat["p99"] <= r["wall_s"] + 1e-3
    assert r["peak_rss_mb"] > 0
    assert plot.read_bytes().startswith(PNG_MAGIC)


def test_bench_streams(tiny_ckpt, tmp_path, capsys):
    plot = tmp_path / "streams.png"
    r = run_cli(
        capsys,
        "bench",
        "streams",
        "--model",
        str(tiny_ckpt),
        "--threads",
        "1",
        "--concurrency",
        "1,3",
        "--steps",
        "40",
        "--plot",
        str(plot),
    )
    assert [lv["n"] for lv in r["levels"]] == [1, 3]
    for lv in r["levels"]:
        assert lv["ttfb_s"]["n"] == lv["n"] and 0 < lv["ttfb_s"]["p50"] <= lv["wall_s"]
        assert lv["rtf"]["max"] > 0 and lv["underrun_streams"] in range(lv["n"] + 1)
        assert lv["all_faster_than_real_time"] == (lv["rtf"]["max"] < 1)
    assert plot.read_bytes().startswith(PNG_MAGIC)


def test_offline_mixed_lengths_spread_the_steps(tiny_ckpt, capsys):
    from chattts_serve.bench.offline import lengths

    assert lengths(100, 4, mixed=False) == [100] * 4
    assert lengths(100, 4, mixed=True) == [25, 50, 75, 100]
    argv = ["bench", "offline", "--model", str(tiny_ckpt), "--threads", "1", "--num-texts", "4", "--steps", "12"]
    r = run_cli(capsys, *argv, "--mixed-lengths")
    # 3 + 6 + 9 + 12 tokens: each text stops at its own length.
    assert r["mixed_lengths"] and r["audio_s"] == pytest.approx((512 * 30 - 4 * 256) / 24000, abs=0.01)


def test_streams_staggered_and_unseeded(tiny_ckpt, capsys):
    argv = ["bench", "streams", "--model", str(tiny_ckpt), "--threads", "1", "--concurrency", "3", "--steps", "16"]
    r = run_cli(capsys, *argv, "--stagger-ms", "50", "--unseeded")
    (lv,) = r["levels"]
    assert lv["stagger_ms"] == 50 and lv["seeded"] is False
    # The last stream starts 100 ms after the first: the level lasts at least that long.
    assert lv["wall_s"] >= 0.1 and lv["ttfb_s"]["n"] == 3


def test_profile_stages_add_up(tiny_ckpt, tmp_path, capsys):
    trace = tmp_path / "trace.json"
    r = run_cli(
        capsys,
        "profile",
        "--model",
        str(tiny_ckpt),
        "--threads",
        "1",
        "--steps",
        "30",
        "--streams",
        "2",
        "--format",
        "wav",
        "--trace",
        str(trace),
    )
    st = r["stages"]
    assert set(st) == {
        "normalise",
        "tokenise",
        "prefill",
        "decode",
        "sampling",
        "decoder",
        "vocoder",
        "encode",
        "other",
    }
    # Both streams are admitted in the first step: one prefill stage (it times a step's prefills together).
    assert st["prefill"]["calls"] == 1 and st["sampling"]["calls"] >= 30 and st["encode"]["calls"] == 2
    assert sum(s["s"] for s in st.values()) == pytest.approx(r["wall_s"], abs=0.01)
    assert st["other"]["s"] >= -0.01
    assert r["weight_mb"] > 0 and r["weight_read_floor_ms"] > 0 and r["floor_ratio"] > 0
    # The step floor adds the cache it reads: 2 streams x at least their prompts, every layer's k and v.
    assert r["kv_read_mb_per_step"] > 0 and r["decode_floor_ms"] > r["weight_read_floor_ms"]
    assert r["rtf_floor"] == pytest.approx(r["decode_floor_ms"] / r["real_time_step_ms"] / 2, abs=2e-3)
    # The trunk is timed inside the step (the eager rows path) and judged against its own floor: the step's
    # floor less the code heads' bytes.
    assert 0 < r["trunk_ms_per_step"] < r["decode_ms_per_step"]
    assert r["weight_read_floor_ms"] < r["trunk_floor_ms"] < r["decode_floor_ms"]
    assert r["trunk_floor_ratio"] == pytest.approx(r["trunk_floor_ms"] / r["trunk_ms_per_step"], abs=2e-3)
    assert r["trunk_ms_p50"] > 0
    names = {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}
    assert {"prefill", "decode", "sampling", "vocoder"} <= names
    # The audio stage however it runs: here eager, on the engine thread (1 thread: no overlap worker).
    audio = r["audio_stage"]
    assert audio["calls"] >= 1 and audio["windows"] >= 2 and audio["engine_s"] > 0 and audio["worker_s"] == 0
    assert audio["x_real_time"] == pytest.approx(r["audio_s"] / audio["engine_s"], rel=0.02)


def test_profile_times_an_audio_stage_the_module_wrappers_never_see(tiny_ckpt, capsys):
    """An OpenVINO audio dtype runs its own graphs, never the eager Decoder and Vocos the decoder/vocoder stages
    wrap: the audio stage is still timed, and the tool puts ``decode_on_device`` back when it ends."""
    pytest.importorskip("openvino")
    from chattts_serve.audio import overlap

    before = overlap.decode_on_device
    r = run_cli(capsys, "profile", "--model", str(tiny_ckpt), "--threads", "1", "--steps", "20", "--format", "pcm",
                "--audio-dtype", "ov-bf16")
    assert r["stages"]["decoder"]["calls"] == 0 and r["stages"]["vocoder"]["calls"] == 0
    audio = r["audio_stage"]
    assert audio["calls"] >= 1 and audio["windows"] >= 1 and audio["engine_s"] + audio["worker_s"] > 0
    assert overlap.decode_on_device is before


def test_profile_reads_its_floor_between_the_timed_steps(tiny_ckpt, capsys, monkeypatch):
    """The floor is read during the timed pass, its reads kept out of the wall time and the first chunk,
    and the step right after each read (caches emptied by it) kept out of the step's time."""
    from chattts_serve.bench import profile

    clock = {"offset": 0.0}
    real = profile.time.perf_counter
    monkeypatch.setattr(profile.time, "perf_counter", lambda: real() + clock["offset"])
    reads: list[int] = []

    def read(self):  # each read "takes" 1000 s of the fake clock
        reads.append(len(self.seconds))
        clock["offset"] += 1000.0
        self.seconds.append(1000.0)
        return 1000.0

    monkeypatch.setattr(profile.FloorProbe, "read", read)
    r = run_cli(capsys, "profile", "--model", str(tiny_ckpt), "--threads", "1", "--steps", "20", "--format", "pcm")
    assert r["floor_reads"] == len(reads) >= 2  # 20 steps: a read every 2
    assert r["weight_read_floor_ms"] == 1e6 and r["floor_read_range_ms"] == [1e6, 1e6]
    assert r["wall_s"] < 1000 and r["first_chunk_s"] < 1000
    assert r["stages"]["other"]["s"] < 1000
    decode_calls = r["stages"]["decode"]["calls"]
    assert r["decode_steps_timed"] == decode_calls - len(reads)
    assert r["decode_ms_per_step"] < 1e6


def test_eval_fp32_against_itself_is_perfect_and_modes_are_bounded(tiny_ckpt, capsys):
    r = run_cli(
        capsys,
        "eval",
        "--model",
        str(tiny_ckpt),
        "--threads",
        "1",
        "--steps",
        "16",
        "--num-texts",
        "2",
        "--modes",
        "fp32,int8-static",
    )
    exact, static = r["modes"]
    assert exact["precision"] == "fp32"
    assert exact["tf_top1_agreement"] == 1.0 and exact["tf_kl_nats"] == 0.0
    assert exact["free_run_code_agreement"] == 1.0 and exact["wav_snr_db"] is None  # inf: identical audio
    assert 0 <= static["tf_top1_agreement"] <= 1 and static["tf_kl_nats"] > 0
    assert static["wav_snr_db"] is not None and "| int8-static |" in r["markdown"]


@pytest.mark.slow
def test_eval_reports_each_audio_dtype_on_fp32s_hidden_states(tiny_ckpt, capsys):
    pytest.importorskip("nncf")
    r = run_cli(
        capsys,
        *("eval", "--model", str(tiny_ckpt), "--threads", "1", "--steps", "12", "--num-texts", "1"),
        *("--modes", "fp32", "--audio-dtypes", "fp32,bf16,ov-int8"),
    )
    exact, bf16, int8 = r["audio_modes"]
    assert exact["audio_dtype"] == "fp32" and exact["wav_snr_db"] is None  # inf: the same decode
    assert bf16["audio_dtype"] == "bf16" and 15 < bf16["wav_snr_db"] < 100
    assert int8["audio_dtype"] == "ov-int8" and 10 < int8["wav_snr_db"] < 100
    assert all(row["free_run_code_agreement"] == 1.0 for row in r["audio_modes"])
    assert "| audio ov-int8 |" in r["markdown"]


def test_bad_flags_fail_cleanly(tiny_ckpt, capsys):
    assert main(["eval", "--model", str(tiny_ckpt), "--modes", "fp16"]) == 2
    assert "fp16 needs a CUDA device" in capsys.readouterr().err
    assert main(["bench", "offline", "--model", str(tiny_ckpt), "--num-texts", "0"]) == 2
    assert main(["profile", "--model", str(tiny_ckpt), "--format", "ogg"]) == 2
    ref = ["--reference-python", "/nonexistent/python"]
    assert main(["bench", "offline", "--model", str(tiny_ckpt), "--mixed-lengths", *ref]) == 2
    assert main(["bench", "streams", "--model", str(tiny_ckpt), "--stagger-ms", "5", *ref]) == 2
    assert main(["bench", "streams", "--model", str(tiny_ckpt), "--stagger-ms", "-1"]) == 2


@pytest.mark.reference
@pytest.mark.skipif(not os.environ.get("CHATTTS_REFERENCE_PYTHON"), reason="needs CHATTTS_REFERENCE_PYTHON")
def test_offline_side_by_side_with_the_reference(tiny_ckpt, capsys):
    r = run_cli(
        capsys,
        "bench",
        "offline",
        "--model",
        str(tiny_ckpt),
        "--threads",
        "1",
        "--num-texts",
        "2",
        "--steps",
        "10",
        "--reference-python",
        os.environ["CHATTTS_REFERENCE_PYTHON"],
    )
    ref = r["reference"]
    assert ref["n"] == 2 and ref["steps"] == 10 and ref["wall_s"] > 0
    assert ref["audio_s"] == pytest.approx(r["audio_s"], rel=0.05)  # same texts, same lengths
    assert r["speedup_vs_reference"] == pytest.approx(r["audio_s_per_s"] / ref["audio_s_per_s"], rel=0.01)


@pytest.mark.parametrize(("precision", "slots", "per_weight"), [("fp32", 1, 4), ("fp32", 2, 4), ("int8-dynamic", 2, 1)])
def test_profile_weight_bytes_per_mode(tiny_ckpt, precision, slots, per_weight):
    from chattts_serve.bench.profile import weight_bytes
    from chattts_serve.engine.engine import Engine

    e = Engine.from_pretrained(tiny_ckpt, config=EngineConfig.with_slots(slots, precision=precision))
    g = e.model.config.gpt
    n = g.num_layers * (
        g.hidden_size * (g.num_heads + 2 * g.num_kv_heads) * g.head_dim
        + g.num_heads * g.head_dim * g.hidden_size
        + 3 * g.hidden_size * g.intermediate_size
    )
    assert weight_bytes(e.model.gpt) == n * per_weight


def test_profile_weight_bytes_of_int4_are_the_packed_streams(tiny_ckpt):
    from chattts_serve.bench.profile import weight_bytes
    from chattts_serve.engine.engine import Engine
    from chattts_serve.kernels.quant import Int4GemvLinear

    e = Engine.from_pretrained(tiny_ckpt, config=EngineConfig.with_slots(2, precision="int4"))
    linears = [m for m in e.model.gpt.modules() if isinstance(m, Int4GemvLinear)]
    weights = sum(m.in_features * m.out_features for m in linears)
    assert linears and weight_bytes(e.model.gpt) == sum(m.packed.nbytes for m in linears)
    if e.model.gpt.fused_decode is not None:  # the C++ layout: half a byte a weight, plus scales and padding
        assert 0.5 * weights < weight_bytes(e.model.gpt) < 0.6 * weights


def test_wait_ready_says_when_the_server_died_at_start_up():
    import subprocess
    import sys

    from chattts_serve.bench.common import wait_ready

    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    proc.wait(timeout=30)
    with pytest.raises(RuntimeError, match="exited with 3"):
        wait_ready("http://127.0.0.1:9", proc, timeout=60)  # port 9: nothing answers
