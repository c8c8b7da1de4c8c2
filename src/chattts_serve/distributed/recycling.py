"""Worker recycling: a replica asks Ray to replace it after ``max_requests`` requests, or once its RSS or
CUDA memory passes a bound (a slow leak, fragmentation), so no replica runs long enough to take its host
or card down.

How a replica goes: the policy trips; from then on the replica's ``check_health`` fails. Ray's controller
then stops it *gracefully*: the replica stops taking requests (Ray's routers send new ones, and retry any
that race in, to the other replicas), its in-flight requests run to their end (up to the deployment's
``graceful_shutdown_timeout_s``), and a fresh replica takes its place. Draining is Ray's, so no client
sees an error for it; refusing requests in the app instead would answer them 503.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RecyclePolicy:
    max_requests: int = 0
    """Synthesis requests a replica serves before it is replaced; 0: no limit."""
    max_rss_bytes: int = 0
    """Resident memory of the replica process past which it is replaced; 0: no limit."""
    max_cuda_bytes: int = 0
    """CUDA memory reserved by the replica's allocator past which it is replaced; 0: no limit."""

    def __post_init__(self) -> None:
        for name in ("max_requests", "max_rss_bytes", "max_cuda_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")

    @property
    def enabled(self) -> bool:
        return bool(self.max_requests or self.max_rss_bytes or self.max_cuda_bytes)

    def reason(self, served: int, rss_bytes: int, cuda_bytes: int) -> str | None:
        """Why a replica in this state must go, or None."""
        if self.max_requests and served >= self.max_requests:
            return f"served {served} requests (limit {self.max_requests})"
        if self.max_rss_bytes and rss_bytes > self.max_rss_bytes:
            return f"RSS {rss_bytes / 2**20:.0f} MiB > {self.max_rss_bytes / 2**20:.0f} MiB"
        if self.max_cuda_bytes and cuda_bytes > self.max_cuda_bytes:
            return f"CUDA memory {cuda_bytes / 2**20:.0f} MiB > {self.max_cuda_bytes / 2**20:.0f} MiB"
        return None


def rss_bytes() -> int:
    """This process's resident set size (Linux /proc; 0 where it cannot be read)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def cuda_bytes() -> int:
    """CUDA memory this process's allocator holds (0 without CUDA, and never initialises CUDA itself)."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return 0
    return sum(torch.cuda.memory_reserved(i) for i in range(torch.cuda.device_count()))


class Recycler:
    """Counts a replica's requests and decides, once and for good, that it must be replaced."""

    def __init__(
        self,
        policy: RecyclePolicy,
        rss: Callable[[], int] = rss_bytes,
        cuda: Callable[[], int] = cuda_bytes,
    ) -> None:
        self.policy, self._rss, self._cuda = policy, rss, cuda
        self.served = 0
        self.in_flight = 0
        self.reason: str | None = None
        """Set when the policy tripped (sticky: a replica that must go stays unhealthy)."""

    def started(self) -> None:
        self.in_flight += 1

    def finished(self) -> None:
        self.in_flight -= 1
        self.served += 1

    def check(self) -> str | None:
        """The reason to replace this replica (None: keep it). Memory is read only when it is bounded."""
        if self.reason is None and self.policy.enabled:
            p = self.policy
            self.reason = p.reason(
                self.served, self._rss() if p.max_rss_bytes else 0, self._cuda() if p.max_cuda_bytes else 0
            )
        return self.reason
