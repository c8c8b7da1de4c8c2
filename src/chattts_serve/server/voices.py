"""Saved voices in an embedded SQLite database (survives restarts), and the built-in voice names.

A voice is either a speaker embedding (a speaker string, given or sampled from a seed) or a voice
sample: the DVAE codes of an uploaded recording plus its transcript, used as a zero-shot prompt.
A built-in voice (``BUILTIN_VOICES``) is a speaker sampled from a fixed seed; a saved voice of the same
name shadows it.

Durability: the database runs in WAL mode with ``synchronous=FULL`` and every write is its own
transaction, committed before ``add``/``delete`` return; so a voice the server has answered 201 for
survives a crash (``kill -9``, power loss) and the file never needs repair.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

_SCHEMA = """
CREATE TABLE IF NOT EXISTS voices (
    name TEXT PRIMARY KEY,
    kind TEXT NOT NULL CHECK (kind IN ('speaker', 'sample')),
    speaker TEXT,
    sample_codes TEXT,
    sample_text TEXT,
    description TEXT,
    created_at REAL NOT NULL
)
"""

BUSY_TIMEOUT_S = 5.0
"""How long a write waits for another writer (another process on the same file) before giving up."""

# OpenAI's voice names, so unmodified clients work (Pipecat refuses any other name): each is a fixed random
# speaker (seeded sample from the checkpoint's speaker statistics), unless a saved voice of that name exists.
# New names go at the end: a name's seed is its position, and a voice must not change under its users.
BUILTIN_VOICES = {
    name: 1000 + i
    for i, name in enumerate(
        (
            "alloy",
            "ash",
            "ballad",
            "coral",
            "echo",
            "fable",
            "nova",
            "onyx",
            "sage",
            "shimmer",
            "verse",
            "cedar",
            "marin",
        )
    )
}


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

    def list(self, limit: int | None = None, after: str | None = None) -> list[VoiceRecord]:
        """Voices by name; ``after``: only names sorting after it (a page cursor); ``limit``: at most that many."""
        rows = self._read(
            "SELECT * FROM voices WHERE name > ? ORDER BY name LIMIT ?",
            ("" if after is None else after, -1 if limit is None else limit),
        )
        return [VoiceRecord(*r) for r in rows]

    def count(self) -> int:
        return self._read("SELECT COUNT(*) FROM voices")[0][0]

    def get(self, name: str) -> VoiceRecord | None:
        rows = self._read("SELECT * FROM voices WHERE name = ?", (name,))
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
    ) -> VoiceRecord:
        """Insert a voice. Raises VoiceExistsError, VoiceLimitError (``max_voices`` already stored) or
        VoiceStoreError."""
        if (speaker is None) == (sample_codes is None):
            raise ValueError("a voice has either a speaker string or a voice sample")
        rec = VoiceRecord(
            name, "speaker" if speaker else "sample", speaker, sample_codes, sample_text, description, time.time()
        )
        try:
            with self._write() as conn:
                if max_voices is not None:
                    (count,) = conn.execute("SELECT COUNT(*) FROM voices").fetchone()
                    if count >= max_voices:
                        raise VoiceLimitError(f"the server holds its maximum of {max_voices} voices; delete one first")
                conn.execute(
                    "INSERT INTO voices VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (
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

    def delete(self, name: str) -> bool:
        with self._write() as conn:
            cur = conn.execute("DELETE FROM voices WHERE name = ?", (name,))
        return cur.rowcount > 0
