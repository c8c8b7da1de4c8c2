"""``chattts-serve ray batch`` on Ray Data, for real: a local Ray cluster on 127.0.0.1 (one for the module)
joined with ``--address``; 2 workers over 20 texts write 20 WAVs and a manifest, byte for byte the files
``chattts-serve synthesize --input`` writes in one process with the same seeds; a rerun skips what exists."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

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


def run_batch(cluster, tiny_ckpt, texts, out) -> dict:
    cmd = cli(
        "ray", "batch", "--address", cluster.address, "--input", str(texts), "--output-dir", str(out),
        "--model", str(tiny_ckpt), "--num-workers", "2", "--num-cpus-per-worker", "0.5", "--no-progress", *SAMPLING,
    )  # fmt: skip
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, env={**os.environ, **RAY_ENV, "OMP_NUM_THREADS": "1"}
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
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
