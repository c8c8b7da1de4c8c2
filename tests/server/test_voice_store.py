"""server/voices.py without a server: voices scoped by tenant, the cap per tenant, and the migration of a
database from before tenants."""

from __future__ import annotations

import sqlite3
from contextlib import closing

import pytest

from chattts_serve.server.voices import VoiceExistsError, VoiceLimitError, VoiceStore

# The table as it was before tenants: the name alone is the key.
OLD_SCHEMA = """
CREATE TABLE voices (
    name TEXT PRIMARY KEY,
    kind TEXT NOT NULL CHECK (kind IN ('speaker', 'sample')),
    speaker TEXT,
    sample_codes TEXT,
    sample_text TEXT,
    description TEXT,
    created_at REAL NOT NULL
)
"""


@pytest.fixture
def store(tmp_path):
    s = VoiceStore(tmp_path / "voices.sqlite3")
    yield s
    s.close()


def test_each_tenant_sees_only_its_own_voices(store):
    store.add("narrator", speaker="none")
    store.add("narrator", speaker="a", tenant="a")  # the same name in another tenant is another voice
    store.add("only-b", speaker="b", tenant="b")
    assert store.get("narrator").speaker == "none"
    assert store.get("narrator", tenant="a").speaker == "a"
    assert store.get("narrator", tenant="b") is None and store.get("only-b", tenant="a") is None
    assert store.get("only-b") is None  # no tenant is not every tenant
    assert [r.name for r in store.list(tenant="b")] == ["only-b"]
    assert [r.name for r in store.list()] == ["narrator"]
    assert (store.count(), store.count(tenant="a"), store.count(tenant="b")) == (1, 1, 1)
    with pytest.raises(VoiceExistsError):
        store.add("narrator", speaker="again", tenant="a")
    assert not store.delete("only-b", tenant="a") and not store.delete("only-b")
    assert store.delete("narrator", tenant="a")
    assert store.get("narrator").speaker == "none" and store.get("only-b", tenant="b") is not None


def test_the_cap_counts_one_tenants_voices(store):
    store.add("a1", speaker="x", tenant="a", max_voices=1)
    with pytest.raises(VoiceLimitError, match="tenant 'a' has its maximum of 1"):
        store.add("a2", speaker="x", tenant="a", max_voices=1)
    store.add("b1", speaker="x", tenant="b", max_voices=1)  # another tenant's quota is its own
    store.add("n1", speaker="x", max_voices=1)
    with pytest.raises(VoiceLimitError, match="the server holds its maximum of 1"):
        store.add("n2", speaker="x", max_voices=1)


def test_a_database_from_before_tenants_keeps_its_voices_as_no_tenants(tmp_path):
    db = tmp_path / "old.sqlite3"
    with closing(sqlite3.connect(db)) as conn, conn:
        conn.execute(OLD_SCHEMA)
        conn.execute("INSERT INTO voices VALUES ('old', 'speaker', 'spk', NULL, NULL, 'kept', 1.0)")
    store = VoiceStore(db)
    try:
        rec = store.get("old")
        assert (rec.name, rec.speaker, rec.description, rec.created_at) == ("old", "spk", "kept", 1.0)
        assert store.get("old", tenant="a") is None
        store.add("old", speaker="a", tenant="a")  # names are unique per tenant now
    finally:
        store.close()
    with closing(VoiceStore(db)) as again:  # opening a migrated file again changes nothing
        assert again.get("old").speaker == "spk" and again.get("old", tenant="a").speaker == "a"
