"""A replica's Prometheus series (``/metrics``: engine gauges, request counters, tenant series) copied
into Ray's metrics, which tag each series with its deployment, replica and application. Prometheus then
scrapes every node's Ray metrics endpoint and sees every replica, where a scrape of ``/metrics`` through
the Serve proxy would reach one replica at random.

Every sample becomes a Ray gauge of the same name (Ray prefixes ``ray_``): counters keep their ``_total``
name and only grow, so ``rate()`` works on them; histograms come as their ``_bucket``/``_sum``/``_count``
series.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


def samples(registry) -> list[tuple[str, str, dict[str, str], float]]:
    """(name, documentation, labels, value) of every sample in ``registry`` but the ``_created`` stamps."""
    out = []
    for family in registry.collect():
        for s in family.samples:
            if not s.name.endswith("_created"):
                out.append((s.name, family.documentation, dict(s.labels), float(s.value)))
    return out


class RayMetricsMirror:
    """Copies ``registry`` into gauges made by ``make_gauge(name, description, tag_keys)`` (in a replica:
    ``ray.serve.metrics.Gauge``, which adds the replica's tags)."""

    def __init__(self, registry, make_gauge: Callable[[str, str, tuple[str, ...]], Any]) -> None:
        self.registry, self.make_gauge = registry, make_gauge
        self.gauges: dict[tuple[str, tuple[str, ...]], Any] = {}

    def sync(self) -> int:
        """Set every gauge from the registry now; returns how many samples were copied."""
        copied = samples(self.registry)
        for name, doc, labels, value in copied:
            keys = tuple(sorted(labels))
            gauge = self.gauges.get((name, keys))
            if gauge is None:
                gauge = self.gauges[(name, keys)] = self.make_gauge(name, doc or name, keys)
            gauge.set(value, tags=labels or None)
        return len(copied)
