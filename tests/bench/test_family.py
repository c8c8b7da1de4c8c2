"""``bench family`` through the real CLI on the tiny Kokoro checkpoint, with a stand-in reference script that
keeps the protocol (bench/family.py's docstring): one JSON line whose figures hang together, and clear errors.
Speed itself is not checked (benchmarks live apart from tests)."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from chattts_serve import models
from chattts_serve.bench import family as bench_family
from chattts_serve.cli import main

pytestmark = pytest.mark.timeout(300)

# Keeps the protocol without a package: records what it was asked, answers 1 s a request, 2 s of audio each.
FAKE_REFERENCE = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    ckpt, jobs = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text(encoding="utf-8"))
    with open(Path(__file__).parent / "seen.jsonl", "a") as f:
        f.write(json.dumps({"ckpt": str(ckpt), "jobs": jobs}) + "\\n")
    n = len(jobs["requests"])
    print("warming up")
    print(json.dumps({"package": "fake 1.0", "single_s": [1.0] * jobs["rounds"],
                      "sequential_s": [float(n - 1)] * jobs["rounds"], "audio_s": [2.0] * n}))
""")


def run_cli(capsys, *argv: str) -> dict:
    assert main(list(argv)) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return json.loads(lines[0])


def test_requests_are_the_protocols():
    reqs, five = bench_family.requests("zh", 3, "zf_xiaobei")
    assert len(reqs) == 4 and reqs[0]["text"] == bench_family.SENTENCES["zh"][0]
    assert all(set(r) == {"text", "voice", "lang", "seed"} for r in reqs)
    assert len({r["seed"] for r in reqs}) == 4 and {r["voice"] for r in reqs} == {"zf_xiaobei"}
    assert five.startswith(reqs[0]["text"]) and five.count("。") == 5
    with pytest.raises(ValueError, match="--requests must be in 1..8"):
        bench_family.requests("en", 9, None)


def test_reference_script_lives_beside_the_family():
    assert bench_family.reference_script(models.get("kokoro")).name == "reference_bench.py"
    with pytest.raises(ValueError, match="the chattts family has no reference benchmark"):
        bench_family.reference_script(models.get("chattts"))


def test_bench_family_against_a_protocol_keeping_reference(tmp_path, capsys, monkeypatch):
    from chattts_serve.models.kokoro.random_checkpoint import write_random

    kokoro_tiny = write_random(tmp_path / "kokoro", "tiny", seed=0, voices=("zf_xiaobei", "af_heart"))
    script = tmp_path / "scripts" / "reference_bench.py"
    script.parent.mkdir()
    script.write_text(FAKE_REFERENCE)
    monkeypatch.setattr(bench_family, "reference_script", lambda family: script)
    r = run_cli(capsys, "bench", "family", "--model", str(kokoro_tiny), "--threads", "1", "--rounds", "2",
                "--requests", "3", "--voice", "zf_xiaobei", "--reference-python", sys.executable)
    assert r["bench"] == "family" and r["family"] == "kokoro" and r["threads"] == 1 and r["requests"] == 3
    assert r["cpu"]["cores"] >= 1 and len(r["load_avg_before"]) == 3
    ours, ref = r["ours"], r["reference"]
    assert len(ours["rounds"]) == 2 and ours["concurrent_audio_s"] > 0
    assert ours["concurrent_audio_s_per_s"] == pytest.approx(ours["concurrent_audio_s"] / ours["concurrent_s"],
                                                             rel=1e-3)
    assert 0 < ours["first_audio_s"] and r["audio_dtype"] == "auto"
    assert r["first_audio_over_first_sentence"] == pytest.approx(ours["first_audio_s"] / ours["single_s"], rel=1e-2)
    assert ref == {"package": "fake 1.0", "single_s": 1.0, "sequential_s": 3.0, "sequential_audio_s": 6.0,
                   "sequential_audio_s_per_s": 2.0,
                   "rounds": [{"single_s": 1.0, "sequential_s": 3.0}] * 2}
    assert r["single_speedup"] == pytest.approx(1.0 / ours["single_s"], rel=1e-2)
    assert r["concurrent_speedup"] == pytest.approx(ours["concurrent_audio_s_per_s"] / 2.0, rel=1e-2)
    # One reference call a round (interleaved), each with one round, every request of the protocol's shape.
    seen = [json.loads(line) for line in (script.parent / "seen.jsonl").read_text().splitlines()]
    assert len(seen) == 2
    for call in seen:
        assert call["ckpt"] == str(kokoro_tiny) and call["jobs"]["threads"] == 1 and call["jobs"]["rounds"] == 1
        assert [q["lang"] for q in call["jobs"]["requests"]] == ["zh"] * 4


def test_bench_family_without_a_reference_script_says_so(tiny_ckpt, capsys):
    assert main(["bench", "family", "--model", str(tiny_ckpt), "--reference-python", sys.executable]) == 2
    assert "the chattts family has no reference benchmark" in capsys.readouterr().err
