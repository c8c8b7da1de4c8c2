"""disk_cache.py: a cache entry appears whole or not at all."""

from __future__ import annotations

import pytest

from chattts_serve import disk_cache


def _write(directory):
    (directory / "data").write_text("x" * 1000)
    (directory / "manifest.json").write_text("{}")


def test_an_entry_appears_whole_and_no_temporary_directory_stays(tmp_path):
    final = tmp_path / "cache" / "entry"
    disk_cache.publish(final, _write, "manifest.json")
    assert sorted(p.name for p in final.iterdir()) == ["data", "manifest.json"]
    assert [p.name for p in final.parent.iterdir()] == ["entry"]


def test_a_failing_write_leaves_nothing(tmp_path):
    def broken(directory):
        (directory / "data").write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        disk_cache.publish(tmp_path / "entry", broken, "manifest.json")
    assert list(tmp_path.iterdir()) == []


def test_an_existing_entry_is_replaced(tmp_path):
    final = tmp_path / "entry"
    final.mkdir()
    (final / "stale").write_text("old")
    disk_cache.publish(final, _write, "manifest.json")
    assert sorted(p.name for p in final.iterdir()) == ["data", "manifest.json"]


@pytest.mark.parametrize("whole", [True, False])
def test_a_concurrent_writers_whole_entry_is_kept_and_a_partial_one_is_an_error(tmp_path, monkeypatch, whole):
    final = tmp_path / "entry"

    def lost_race(src, dst):  # another writer renamed its entry into place first
        final.mkdir()
        if whole:
            (final / "manifest.json").write_text("{}")
        raise OSError(39, "Directory not empty")

    monkeypatch.setattr(disk_cache.os, "replace", lost_race)
    if whole:
        disk_cache.publish(final, _write, "manifest.json")
    else:
        with pytest.raises(OSError):
            disk_cache.publish(final, _write, "manifest.json")
    assert [p.name for p in tmp_path.iterdir()] == ["entry"]  # its own copy dropped either way


def test_files_digest_follows_contents_and_reads_an_unchanged_file_once(tmp_path):
    for root in (tmp_path / "a", tmp_path / "b"):
        (root / "sub").mkdir(parents=True)
        (root / "sub" / "w.bin").write_bytes(b"\1" * 5000)
        (root / "c.json").write_text("{}")
    rels = ("sub/w.bin", "c.json", "missing.txt")
    disk_cache._content_digest.cache_clear()
    a = disk_cache.files_digest(tmp_path / "a", rels)
    assert disk_cache.files_digest(tmp_path / "a", rels) == a
    assert disk_cache._content_digest.cache_info().misses == 2  # each present file read once
    assert disk_cache.files_digest(tmp_path / "b", rels) == a  # the same contents elsewhere
    (tmp_path / "b" / "c.json").write_text('{"x": 1}')
    assert disk_cache.files_digest(tmp_path / "b", rels) != a
