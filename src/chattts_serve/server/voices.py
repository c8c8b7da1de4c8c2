"""Saved voices in an embedded SQLite database (survives restarts).

A voice is either a speaker embedding (a speaker string, given or sampled from a seed) or a voice
sample: the DVAE codes of an uploaded recording plus its transcript, used as a zero-shot prompt.
"""

from __future__ import annotations

import sqlite3
import threading
import time
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


class VoiceStore:
    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        # One connection shared by the server's threads, serialised by a lock (writes are rare).
        self._conn = sqlite3.connect(self.path, check_same_thread=False)
        self._lock = threading.Lock()
        with self._lock, self._conn:
            self._conn.execute(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def list(self) -> list[VoiceRecord]:
        with self._lock:
            rows = self._conn.execute("SELECT * FROM voices ORDER BY name").fetchall()
        return [VoiceRecord(*r) for r in rows]

    def get(self, name: str) -> VoiceRecord | None:
        with self._lock:
            row = self._conn.execute("SELECT * FROM voices WHERE name = ?", (name,)).fetchone()
        return VoiceRecord(*row) if row else None

    def add(
        self,
        name: str,
        *,
        speaker: str | None = None,
        sample_codes: str | None = None,
        sample_text: str | None = None,
        description: str | None = None,
    ) -> VoiceRecord:
        if (speaker is None) == (sample_codes is None):
            raise ValueError("a voice has either a speaker string or a voice sample")
        rec = VoiceRecord(
            name, "speaker" if speaker else "sample", speaker, sample_codes, sample_text, description, time.time()
        )
        try:
            with self._lock, self._conn:
                self._conn.execute(
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
        with self._lock, self._conn:
            cur = self._conn.execute("DELETE FROM voices WHERE name = ?", (name,))
        return cur.rowcount > 0
