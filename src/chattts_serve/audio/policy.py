"""``StreamPolicy``: how a stream's audio is cut into chunks (sizes, context, lookahead, crossfade).
A configuration, kept apart from the mechanism (``audio.stream``) so configs can use it without torch."""

from __future__ import annotations

from dataclasses import dataclass

from ..models.chattts.config import SAMPLES_PER_TOKEN


@dataclass(frozen=True, slots=True)
class StreamPolicy:
    first_chunk: int = 4
    """Steps in the first chunk (4 steps = 85 ms of audio). The first audio leaves after
    ``first_chunk + lookahead`` steps; a small first chunk costs no seam quality, a short lookahead
    would (seams in BENCHMARKS.md, "First chunk after the default chunk-size change")."""
    max_chunk: int = 96
    """Chunks grow x2 per chunk up to this many steps."""
    left_context: int = 16
    """Steps decoded before a chunk and thrown away."""
    lookahead: int = 10
    """Steps that must exist after a chunk before it is decoded (adds latency, removes seam error)."""
    crossfade: int = 256
    """Samples of overlap blended between consecutive chunks."""

    def __post_init__(self) -> None:
        for name in ("first_chunk", "max_chunk", "left_context", "lookahead", "crossfade"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"StreamPolicy.{name} must be an int >= 0, got {v!r}")
        if self.first_chunk < 1 or self.max_chunk < self.first_chunk:
            raise ValueError(f"need 1 <= first_chunk <= max_chunk, got {self.first_chunk}, {self.max_chunk}")
        # A chunk's last 256 samples need the next step's frames, and the crossfade needs more.
        if self.crossfade + SAMPLES_PER_TOKEN // 2 > self.lookahead * SAMPLES_PER_TOKEN:
            raise ValueError(
                f"lookahead ({self.lookahead} steps) must cover crossfade ({self.crossfade} samples) + 256 samples"
            )

    @classmethod
    def one_shot(cls) -> StreamPolicy:
        """Decode each utterance once, when it is complete (offline synthesis)."""
        big = 1 << 30
        return cls(first_chunk=big, max_chunk=big, left_context=0, lookahead=1, crossfade=0)
