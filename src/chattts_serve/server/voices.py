"""Saved voices in an embedded SQLite database (survives restarts), and the built-in voice names.

A voice is either a speaker embedding (a speaker string, given or sampled from a seed) or a voice
sample: the DVAE codes of an uploaded recording plus its transcript, used as a zero-shot prompt.
A built-in voice (``BUILTIN_VOICES``) is a speaker sampled from a fixed seed; a saved voice of the same
name shadows it.

Durability: the database runs in WAL mode with ``synchronous=FULL`` and every write is its own
transaction, committed before ``add``/``delete`` return; so a voice the server has answered 201 for
survives a crash (``kill -9``, power loss) and the file never needs repair.

Tenants: every voice belongs to one tenant (or to none, on a server without tenants), and every call names
the tenant whose voices it sees (``tenant=None``: the voices of no tenant). A tenant never sees, speaks with
or deletes another's voice, and ``max_voices`` counts one tenant's voices. A database from before tenants is
migrated when it is opened: its voices become the voices of no tenant.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from ..models.chattts.voices import BUILTIN_VOICES  # noqa: F401 - ChatTTS's built-in names, where they always were

_COLUMNS = "name, kind, speaker, sample_codes, sample_text, description, created_at"
"""A ``VoiceRecord``'s columns, in its field order."""

# ``tenant``: the tenant that owns the voice ('' for no tenant: a server without tenants). Names are unique
# per tenant, so two tenants may each have a voice "narrator".
_SCHEMA = """
CREATE TABLE IF NOT EXISTS voices (
    tenant TEXT NOT NULL DEFAULT '',
    name TEXT NOT NULL,
    kind TEXT NOT NULL CHECK (kind IN ('speaker', 'sample')),
    speaker TEXT,
    sample_codes TEXT,
    sample_text TEXT,
    description TEXT,
    created_at REAL NOT NULL,
    PRIMARY KEY (tenant, name)
)
"""

BUSY_TIMEOUT_S = 5.0
"""How long a write waits for another writer (another process on the same file) before giving up."""


def family_store_path(path: str | Path, family: str) -> Path:
    """The database of ``family``'s saved voices: a voice is a family's voice string (a ChatTTS speaker string
    means nothing to Kokoro), so each family has its own store. ChatTTS keeps ``path`` itself (the databases of
    servers from before families); another family's sits beside it (``voices.db`` -> ``voices.kokoro.db``)."""
    path = Path(path)
    if family == "chattts" or str(path) == ":memory:":
        return path
    return path.with_name(f"{path.stem}.{family}{path.suffix}")


@dataclass(frozen=True, slots=True)
class VoiceRecord:
    name: str
    kind: str
    speaker: str | None
    sample_codes: str | None
    sample_text: str | None
    description: str | None
    created_at: float


class VoiceExistsError(ValueError):
    pass


class VoiceLimitError(ValueError):
    """The store already holds its maximum number of voices."""


class VoiceStoreError(RuntimeError):
    """The database failed. ``kind``: "busy" (locked by another writer; worth a retry), "full" (the disk
    or database is full) or "error" (anything else). The message is generic; the cause is chained."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def _classify(exc: sqlite3.Error) -> VoiceStoreError:
    name = getattr(exc, "sqlite_errorname", "") or ""
    text = str(exc).lower()
    if name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")) or "locked" in text or "busy" in text:
        return VoiceStoreError("busy", "the voices database is busy")
    if name.startswith("SQLITE_FULL") or "is full" in text:
        return VoiceStoreError("full", "the voices database is full (no space left)")
    return VoiceStoreError("error", "the voices database failed")


class VoiceStore:
    def __init__(self, path: str | Path, busy_timeout_s: float = BUSY_TIMEOUT_S) -> None:
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        # Two connections, each shared by the server's threads and serialised by its own lock: reads
        # (synthesis requests resolve voice names on the event loop) must never queue behind a write
        # that waits for another process's lock. In WAL mode a reader does not wait for a writer.
        # ":memory:" is one database per connection, so there both roles share one connection.
        self._writer = self._connect(busy_timeout_s)
        self._reader = self._writer if self.path == ":memory:" else self._connect(busy_timeout_s)
        self._write_lock = threading.Lock()
        self._read_lock = self._write_lock if self._reader is self._writer else threading.Lock()
        self.version = 0
        """Bumped by every write this store commits: a cache of what it holds (Wyoming's describe) is stale
        when it changes (writes by another process on the same file are not seen: keep such caches short)."""
        with self._write_lock, self._translated():
            self._writer.execute(_SCHEMA)
            migrate = not _has_tenant_column(self._writer)
        if migrate:
            with self._write() as conn:  # checked again inside: another process may have migrated it meanwhile
                _add_tenant_column(conn)

    def _connect(self, busy_timeout_s: float) -> sqlite3.Connection:
        # isolation_level=None: no implicit transactions; each write opens its own (BEGIN IMMEDIATE).
        conn = sqlite3.connect(self.path, timeout=busy_timeout_s, check_same_thread=False, isolation_level=None)
        with self._translated():
            conn.execute("PRAGMA journal_mode=WAL")  # a no-op for :memory: (and falls back where unsupported)
            conn.execute("PRAGMA synchronous=FULL")  # a commit is on disk before the client hears 201
        return conn

    @contextmanager
    def _translated(self) -> Iterator[None]:
        try:
            yield
        except sqlite3.IntegrityError:
            raise
        except sqlite3.Error as exc:
            raise _classify(exc) from exc

    def close(self) -> None:
        with self._write_lock:
            self._writer.close()
        if self._reader is not self._writer:
            with self._read_lock:
                self._reader.close()

    def _read(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._read_lock, self._translated():
            return self._reader.execute(sql, args).fetchall()

    def list(
        self, limit: int | None = None, after: str | None = None, *, tenant: str | None = None
    ) -> list[VoiceRecord]:
        """A tenant's voices by name; ``after``: only names sorting after it (a page cursor); ``limit``: at most
        that many."""
        rows = self._read(
            f"SELECT {_COLUMNS} FROM voices WHERE tenant = ? AND name > ? ORDER BY name LIMIT ?",
            (_owner(tenant), "" if after is None else after, -1 if limit is None else limit),
        )
        return [VoiceRecord(*r) for r in rows]

    def count(self, *, tenant: str | None = None) -> int:
        return self._read("SELECT COUNT(*) FROM voices WHERE tenant = ?", (_owner(tenant),))[0][0]

    def get(self, name: str, *, tenant: str | None = None) -> VoiceRecord | None:
        rows = self._read(f"SELECT {_COLUMNS} FROM voices WHERE tenant = ? AND name = ?", (_owner(tenant), name))
        return VoiceRecord(*rows[0]) if rows else None

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction, committed (and on disk) when the block ends, rolled back on error.
        IMMEDIATE takes the write lock first, so a check inside (the voice count) stays true until commit."""
        with self._write_lock, self._translated():
            conn = self._writer
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
                conn.execute("COMMIT")
                self.version += 1
            except BaseException:
                # Some errors (SQLITE_FULL) end the transaction themselves; a failed COMMIT leaves it open.
                if conn.in_transaction:
                    with suppress(sqlite3.Error):
                        conn.execute("ROLLBACK")
                raise

    def add(
        self,
        name: str,
        *,
        speaker: str | None = None,
        sample_codes: str | None = None,
        sample_text: str | None = None,
        description: str | None = None,
        max_voices: int | None = None,
        tenant: str | None = None,
    ) -> VoiceRecord:
        """Insert a voice of ``tenant``. Raises VoiceExistsError, VoiceLimitError (the tenant already has
        ``max_voices``) or VoiceStoreError."""
        if (speaker is None) == (sample_codes is None):
            raise ValueError("a voice has either a speaker string or a voice sample")
        rec = VoiceRecord(
            name, "speaker" if speaker else "sample", speaker, sample_codes, sample_text, description, time.time()
        )
        try:
            with self._write() as conn:
                if max_voices is not None:
                    (count,) = conn.execute(
                        "SELECT COUNT(*) FROM voices WHERE tenant = ?", (_owner(tenant),)
                    ).fetchone()
                    if count >= max_voices:
                        raise VoiceLimitError(limit_message(max_voices, tenant))
                conn.execute(
                    f"INSERT INTO voices (tenant, {_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        _owner(tenant),
                        rec.name,
                        rec.kind,
                        rec.speaker,
                        rec.sample_codes,
                        rec.sample_text,
                        rec.description,
                        rec.created_at,
                    ),
                )
        except sqlite3.IntegrityError:
            raise VoiceExistsError(f"voice {name!r} already exists") from None
        return rec

    def delete(self, name: str, *, tenant: str | None = None) -> bool:
        with self._write() as conn:
            cur = conn.execute("DELETE FROM voices WHERE tenant = ? AND name = ?", (_owner(tenant), name))
        return cur.rowcount > 0


def limit_message(max_voices: int, tenant: str | None) -> str:
    # a plain API key's owner is a fingerprint (server.auth.key_owner): not a name to show
    holder = "the server holds" if tenant is None else "this API key has" if ":" in tenant else f"tenant {tenant!r} has"
    return f"{holder} its maximum of {max_voices} voices; delete one first"


def _owner(tenant: str | None) -> str:
    """The ``tenant`` column's value: '' for no tenant (a tenant name is never empty)."""
    return "" if tenant is None else tenant


def _has_tenant_column(conn: sqlite3.Connection) -> bool:
    return "tenant" in {row[1] for row in conn.execute("PRAGMA table_info(voices)")}


def _add_tenant_column(conn: sqlite3.Connection) -> None:
    """Migrates a database from before tenants (``name`` alone the key): its voices become the voices of no
    tenant. SQLite cannot change a primary key in place, so the table is copied (inside the caller's
    transaction: a crash midway leaves the old table as it was)."""
    if _has_tenant_column(conn):
        return
    conn.execute(_SCHEMA.replace("voices (", "voices_new (", 1))
    conn.execute(f"INSERT INTO voices_new (tenant, {_COLUMNS}) SELECT '', {_COLUMNS} FROM voices")
    conn.execute("DROP TABLE voices")
    conn.execute("ALTER TABLE voices_new RENAME TO voices")
