"""Batch jobs without Ray: inputs -> items (ids, seeds), sharding, manifest and resume; and
``synthesize --input ... --devices cpu,cpu`` (one process per device) writes the same files as one process."""

from __future__ import annotations

import json

import pytest

from chattts_serve.cli import main
from chattts_serve.distributed import jobs
from chattts_serve.distributed.jobs import (
    Item,
    ManifestEntry,
    append_manifest,
    item_params,
    pending,
    read_items,
    read_manifest,
    shard,
    with_seed,
)
from chattts_serve.sampling_params import SamplingParams


def test_text_lines_get_synthesize_numbering(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("一。\n\n  \n二。\n三。\n", encoding="utf-8")
    items = read_items(path)
    assert [(it.id, it.text) for it in items] == [("0001", "一。"), ("0002", "二。"), ("0003", "三。")]
    assert [it.file_name for it in items] == ["0001.wav", "0002.wav", "0003.wav"]


def test_jsonl_ids_and_seeds(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [{"id": "a", "text": "x", "seed": 5}, {"text": "y"}, {"id": "c", "text": "z"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    items = read_items(path)
    assert items == [Item("a", "x", 5), Item("0002", "y"), Item("c", "z")]
    seeded = with_seed(items, 9)
    assert [it.seed for it in seeded] == [5, 9, 9]  # an item's own seed wins over the job's
    base = SamplingParams(seed=9, refine_text=False)
    assert item_params(base, seeded[0]).seed == 5 and item_params(base, seeded[1]) is base


def test_jsonl_voices_and_options_are_each_items_over_the_jobs(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [
        {"id": "a", "text": "x", "voice": "af_bella(2)+af_sky(1)", "options": {"speed": 1.5}},
        {"id": "b", "text": "y", "options": {"lang_code": "z", "noise_scale": None}},
        {"id": "c", "text": "z"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    a, b, c = read_items(path)
    assert a == Item("a", "x", None, "af_bella(2)+af_sky(1)", {"speed": 1.5})
    assert b == Item("b", "y", None, None, {"lang_code": "z"})  # None: the default, as a flag left out
    base = SamplingParams(speaker="af_heart", options={"speed": 0.8, "lang_code": "a"})
    pa = item_params(base, a)
    assert pa.speaker == "af_bella(2)+af_sky(1)" and pa.options == {"speed": 1.5, "lang_code": "a"}
    pb = item_params(base, b)
    assert pb.speaker == "af_heart" and pb.options == {"speed": 0.8, "lang_code": "z"}
    assert item_params(base, c) is base


def test_parquet_input(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "t.parquet"
    table = {
        "id": ["p1", "p2"],
        "text": ["x", "y"],
        "seed": [1, None],
        "voice": ["af_sky", None],
        "options": [{"speed": 2.0}, {"lang_code": "b"}],  # one struct column: each row gets the other's key as null
    }
    pq.write_table(pa.table(table), path)
    assert read_items(path) == [
        Item("p1", "x", 1, "af_sky", {"speed": 2.0}),
        Item("p2", "y", None, None, {"lang_code": "b"}),
    ]


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ('{"text": ""}\n', "non-empty"),
        ('{"id": "../x", "text": "a"}\n', "id must be"),
        ('{"text": "a", "seed": -1}\n', "seed must be"),
        ('{"text": "a", "speaker": "x"}\n', "unknown field"),
        ('{"text": "a", "voice": ""}\n', "voice must be"),
        ('{"text": "a", "options": [1]}\n', "options must be"),
        ('{"text": "a", "options": {"sped": 2}}\n', "unknown option.*sped.*speed"),
        ('{"id": "a", "text": "x"}\n{"id": "a", "text": "y"}\n', "more than once"),
        ("[1, 2]\n", "expected an object"),
        ("{oops\n", "not JSON"),
        ("\n", "no texts"),
    ],
)
def test_bad_inputs_name_the_line(tmp_path, content, match):
    path = tmp_path / "t.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=match):
        read_items(path)


def test_shards_have_equal_counts_and_balanced_lengths():
    items = [Item(f"{i:02d}", "x" * (i * 7 % 23 + 1)) for i in range(23)]
    shards = shard(items, 4)
    assert sorted(len(s) for s in shards) == [5, 6, 6, 6]
    assert sorted(it.id for s in shards for it in s) == [it.id for it in items]  # each item exactly once
    assert all(s == sorted(s, key=lambda it: it.id) for s in shards)  # input order inside a shard
    totals = [sum(len(it.text) for it in s) for s in shards]
    assert max(totals) - min(totals) <= max(len(it.text) for it in items)
    assert shard(items, 4) == shards  # deterministic
    assert shard(items[:1], 3) == [[items[0]], [], []]
    with pytest.raises(ValueError):
        shard(items, 0)


def test_resume_skips_what_is_done(tmp_path):
    items = [Item("a", "x"), Item("b", "y"), Item("c", "z")]
    (tmp_path / "a.wav").write_bytes(b"RIFF")
    append_manifest(
        tmp_path,
        [
            ManifestEntry("a", "x", "a.wav", 1.0, None),
            ManifestEntry("b", "y", "b.wav", 1.0, None),  # its file is gone: redo
            ManifestEntry("c", "z", None, 0.0, None, error="bad"),  # failed: redo
        ],
    )
    with open(tmp_path / "manifest.jsonl", "a") as f:
        f.write('{"id": "torn", "te')  # a crash mid-line
    assert [it.id for it in pending(items, tmp_path)] == ["b", "c"]
    assert set(read_manifest(tmp_path)) == {"a", "b", "c"}


@pytest.mark.parametrize("cut", ["multibyte", "ascii"])
def test_a_torn_manifest_tail_redoes_exactly_the_lost_entry(tmp_path, cut, caplog):
    """A crash mid-write leaves a torn last line: inside a multi-byte character it made every rerun fail with
    UnicodeDecodeError; in ASCII the next append was glued to the fragment and its entry lost."""
    items = [Item("a", "你好。"), Item("b", "天气很好。"), Item("c", "好的。")]
    for it in items:
        (tmp_path / it.file_name).write_bytes(b"RIFF")
    entries = [ManifestEntry(it.id, it.text, it.file_name, 1.0, None) for it in items]
    append_manifest(tmp_path, entries)
    manifest = tmp_path / "manifest.jsonl"
    data = manifest.read_bytes()
    last = data.rindex(b"\n", 0, len(data) - 1) + 1  # where c's line starts
    # multibyte: one byte of the three of c's "好"; ascii: within '{"id": "c"'
    cut_at = data.index("好".encode(), last) + 1 if cut == "multibyte" else last + 8
    manifest.write_bytes(data[:cut_at])
    with caplog.at_level("WARNING"):
        assert [it.id for it in pending(items, tmp_path)] == ["c"]
    assert "torn last line" in caplog.text
    append_manifest(tmp_path, entries[2:])  # the rerun
    assert pending(items, tmp_path) == [] and read_manifest(tmp_path) == {e.id: e for e in entries}
    assert manifest.read_bytes() == data  # the fragment is gone, the entry whole


def test_a_batch_is_written_at_once(tmp_path, monkeypatch):
    """One write per batch: a crash tears at most the batch's own tail, never interleaves with another writer."""
    writes = []

    def spy_open(*args, **kw):
        f = open(*args, **kw)
        write = f.write
        f.write = lambda data: (writes.append(data), write(data))[1]
        return f

    monkeypatch.setattr(jobs, "open", spy_open, raising=False)
    append_manifest(tmp_path, [ManifestEntry(x, x, f"{x}.wav", 1.0, None) for x in "abc"])
    assert len(writes) == 1 and writes[0].count(b"\n") == 3


@pytest.mark.integration  # a worker process per device
def test_devices_split_the_texts_and_write_what_one_process_writes(tiny_ckpt, tmp_path):
    texts = tmp_path / "texts.txt"
    texts.write_text("".join(f"第{i}句话。\n" for i in range(1, 6)), encoding="utf-8")
    common = ["--input", str(texts), "--model", str(tiny_ckpt), "--seed", "3", "--no-refine"]
    common += ["--max-new-tokens", "6", "--min-new-tokens", "6", "--max-num-seqs", "4"]
    assert main(["synthesize", *common, "--output-dir", str(tmp_path / "one")]) == 0
    assert main(["synthesize", *common, "--output-dir", str(tmp_path / "two"), "--devices", "cpu,cpu"]) == 0
    names = sorted(p.name for p in (tmp_path / "one").glob("*.wav"))
    assert names == [f"{i:04d}.wav" for i in range(1, 6)]
    for name in names:
        assert (tmp_path / "two" / name).read_bytes() == (tmp_path / "one" / name).read_bytes(), name
    assert main(["synthesize", "hello", "--devices", "cpu,cpu", "--model", str(tiny_ckpt)]) == 2  # needs --input


def test_ray_batch_takes_a_familys_own_options(tmp_path, monkeypatch):
    """``ray batch --noise-scale``: the job's base params carry VITS's noise scales, as ``synthesize``'s do."""
    from chattts_serve.distributed import cluster, ray_batch
    from chattts_serve.models.vits.random_checkpoint import write_random

    root = write_random(tmp_path / "v", "tiny")
    (tmp_path / "in.txt").write_text("hello world\n", encoding="utf-8")
    seen = {}
    monkeypatch.setattr(cluster, "connect", lambda *a, **k: None)
    monkeypatch.setattr(ray_batch, "run_batch", lambda items, out, **kw: seen.update(kw) or {"failed": 0})
    monkeypatch.setattr("ray.shutdown", lambda: None)
    argv = ["ray", "batch", "--input", str(tmp_path / "in.txt"), "--output-dir", str(tmp_path / "out")]
    assert main([*argv, "--model", str(root), "--noise-scale", "0.2", "--noise-scale-duration", "0"]) == 0
    assert seen["base"].options == {"noise_scale": 0.2, "noise_scale_duration": 0.0}
    assert seen["family"] is None  # detected from the checkpoint, by each worker as by `synthesize`
    assert main([*argv, "--model", str(root), "--family", "vits"]) == 0 and seen["family"] == "vits"


def test_ray_batch_rows_carry_each_items_seed_voice_and_options():
    """An item survives the Dataset's columns (one type each: no seed, voice or options has a stand-in)."""
    from chattts_serve.distributed.ray_batch import from_row, to_row

    for item in (Item("a", "x"), Item("b", "y", 7, "af_bella(2)+af_sky(1)", {"speed": 1.5, "lang_code": "z"})):
        row = to_row(item)
        assert from_row(*(row[k] for k in ("id", "text", "seed", "voice", "options"))) == item
