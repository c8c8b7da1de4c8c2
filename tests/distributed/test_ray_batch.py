"""``chattts-serve ray batch`` on Ray Data, for real: a local Ray cluster on 127.0.0.1 (one for the module)
joined with ``--address``; 2 workers over 20 texts write 20 WAVs and a manifest, byte for byte the files
``chattts-serve synthesize --input`` writes in one process with the same seeds; a rerun skips what exists.
Kokoro and VITS (detected from their checkpoints' files) go the same way: each row's voice and options reach the
model, every WAV is the in-process engine's audio for the same inputs at the family's rate, and a row the model
refuses fails alone."""

from __future__ import annotations

import json
import os
import subprocess
import wave

import pytest

from chattts_serve.audio.wav import to_pcm16
from chattts_serve.cli import main

from .conftest import RAY_ENV, cli, ray_cluster

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]

SAMPLING = ["--seed", "5", "--no-refine", "--max-new-tokens", "12", "--max-num-seqs", "4"]


@pytest.fixture(scope="module")
def cluster():
    with ray_cluster() as c:
        yield c


@pytest.fixture(scope="module")
def job(tiny_ckpt, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ray-batch")
    texts = tmp / "texts.txt"
    texts.write_text("".join(f"这是第{i}句话。\n" for i in range(1, 21)), encoding="utf-8")
    reference = tmp / "reference"
    assert (
        main(
            ["synthesize", "--input", str(texts), "--output-dir", str(reference), "--model", str(tiny_ckpt)] + SAMPLING
        )
        == 0
    )
    return tmp, texts, reference


def run_batch(cluster, tiny_ckpt, texts, out, flags=SAMPLING, returncode=0) -> dict:
    cmd = cli(
        "ray", "batch", "--address", cluster.address, "--input", str(texts), "--output-dir", str(out),
        "--model", str(tiny_ckpt), "--num-workers", "2", "--num-cpus-per-worker", "0.5", "--no-progress", *flags,
    )  # fmt: skip
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, env={**os.environ, **RAY_ENV, "OMP_NUM_THREADS": "1"}
    )
    assert proc.returncode == returncode, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_two_workers_write_what_one_process_writes_and_a_rerun_skips(cluster, tiny_ckpt, job):
    tmp, texts, reference = job
    out = tmp / "out"
    summary = run_batch(cluster, tiny_ckpt, texts, out)
    assert (summary["total"], summary["done"], summary["skipped"], summary["failed"]) == (20, 20, 0, 0)
    names = [f"{i:04d}.wav" for i in range(1, 21)]
    assert sorted(p.name for p in out.glob("*.wav")) == names
    for name in names:
        assert (out / name).read_bytes() == (reference / name).read_bytes(), name
    manifest = [json.loads(line) for line in (out / "manifest.jsonl").read_text(encoding="utf-8").splitlines()]
    assert sorted(e["id"] for e in manifest) == [n[:4] for n in names]
    by_id = {e["id"]: e for e in manifest}
    assert by_id["0007"]["text"] == "这是第7句话。" and by_id["0007"]["file"] == "0007.wav"
    assert all(e["seed"] == 5 and e["duration"] > 0 and e["error"] is None for e in manifest)

    (out / "0003.wav").unlink()  # lost: done again on the rerun; everything else is skipped
    again = run_batch(cluster, tiny_ckpt, texts, out)
    assert (again["done"], again["skipped"]) == (1, 19)
    assert (out / "0003.wav").read_bytes() == (reference / "0003.wav").read_bytes()
    assert not list(out.glob(".*.tmp"))  # files appear whole (written aside, then renamed)


def kokoro_job(tmp):
    pytest.importorskip("misaki")  # Kokoro's text front-end (the [kokoro] extra)
    from chattts_serve import models

    root = models.get("kokoro").write_random(tmp / "kokoro", "tiny")
    zh = "你好，世界。"
    rows = [
        {"id": "r1", "text": zh, "seed": 2, "voice": "zm_yunjian"},
        {"id": "r2", "text": zh, "seed": 2},  # the job's voice (--speaker)
        {"id": "r3", "text": zh, "seed": 2, "options": {"speed": 2.0}},
        {"id": "r4", "text": "Hi there.", "seed": 3, "voice": "af_bella(2)+af_sky(1)", "options": {"lang_code": "b"}},
        {"id": "r5", "text": zh, "seed": 1, "options": {"speed": 9.0}},  # out of Kokoro's range
    ]
    return root, rows, ["--speaker", "zf_xiaobei", "--max-num-seqs", "2"], "speed"


def vits_job(tmp):
    from chattts_serve.models.vits.random_checkpoint import write_random

    root = write_random(tmp / "vits", "tiny", seed=0, num_speakers=3, speaker_embedding_size=8)
    text = "Hello there."
    rows = [
        {"id": "r1", "text": text, "seed": 1, "voice": "speaker_2"},
        {"id": "r2", "text": text, "seed": 1},  # the job's voice (--speaker) and noise (--noise-scale)
        {"id": "r3", "text": text, "seed": 1, "options": {"speed": 2.0}},
        {"id": "r4", "text": "Goodnight.", "seed": 3, "voice": "speakers:0=0.25,2=0.75", "options": {"noise_scale": 0}},
        {"id": "r5", "text": text, "seed": 1, "options": {"noise_scale": 11.0}},  # out of VITS's range
    ]
    return root, rows, ["--speaker", "speaker_1", "--noise-scale", "0.3", "--max-num-seqs", "2"], "noise_scale"


@pytest.mark.parametrize(("make_job", "rate"), [(kokoro_job, 24000), (vits_job, 16000)], ids=["kokoro", "vits"])
def test_a_batch_familys_rows_are_the_in_process_engines_audio_with_their_voices_and_options(
    cluster, tmp_path, make_job, rate
):
    from chattts_serve.engine.engine import Engine
    from chattts_serve.sampling_params import SamplingParams

    root, rows, flags, refused_option = make_job(tmp_path)
    texts = tmp_path / "texts.jsonl"
    texts.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    out = tmp_path / "out"
    summary = run_batch(cluster, root, texts, out, flags=flags, returncode=1)
    assert (summary["total"], summary["done"], summary["failed"]) == (5, 4, 1)
    manifest = {e["id"]: e for e in map(json.loads, (out / "manifest.jsonl").read_text(encoding="utf-8").splitlines())}
    assert manifest["r5"]["file"] is None and refused_option in manifest["r5"]["error"]  # it failed alone
    assert not (out / "r5.wav").exists()

    # The same rows through the engine in this process, each row's params spelt out here (not by jobs.py):
    # the job's --speaker and --noise-scale under the row's own voice and options.
    engine = Engine.from_pretrained(root)
    job_voice = flags[flags.index("--speaker") + 1]
    job_options = {"noise_scale": 0.3} if "--noise-scale" in flags else {}
    spoken = rows[:4]
    params = [
        SamplingParams(seed=r["seed"], speaker=r.get("voice", job_voice), options=job_options | r.get("options", {}))
        for r in spoken
    ]
    results = engine.synthesize([r["text"] for r in spoken], params)
    frames = {}
    for r, result in zip(spoken, results, strict=True):
        with wave.open(str(out / f"{r['id']}.wav"), "rb") as w:
            assert w.getframerate() == rate == engine.sample_rate == result.sample_rate, r["id"]  # the family's
            frames[r["id"]] = w.getnframes()
            assert frames[r["id"]] == len(result.audio), r["id"]
            assert w.readframes(w.getnframes()) == to_pcm16(result.audio), r["id"]
        assert manifest[r["id"]]["duration"] == round(result.duration, 4) and manifest[r["id"]]["seed"] == r["seed"]
    # Each row's voice and options reached the model: r1 and r2 differ in voice only, r3 and r2 in speed only.
    assert (out / "r1.wav").read_bytes() != (out / "r2.wav").read_bytes()
    assert frames["r3"] < frames["r2"]
