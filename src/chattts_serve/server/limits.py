"""How many requests a server runs at once: beyond ``max_in_flight``, new ones are refused with a 429 at
once instead of waiting in front of the engine's own queue."""

from __future__ import annotations

from .errors import busy


class Limits:
    """Requests in flight, bounded (beyond it: 429)."""

    def __init__(self, max_in_flight: int) -> None:
        self.max_in_flight = max_in_flight
        self.in_flight = 0

    def acquire(self) -> None:
        if self.in_flight >= self.max_in_flight:
            raise busy(f"too many concurrent requests ({self.max_in_flight}); retry shortly")
        self.in_flight += 1

    def release(self) -> None:
        self.in_flight -= 1
