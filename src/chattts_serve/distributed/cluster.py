"""Joining or starting the Ray cluster a command runs on."""

from __future__ import annotations

import os

LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
"""Set for a local cluster on 127.0.0.1: without the first, Ray binds the machine's external address even
when told 127.0.0.1; the second keeps usage statistics at home."""


def connect(address: str | None, num_cpus: int | None = None, num_gpus: int | None = None) -> None:
    """Join the cluster at ``address`` ("auto": the one this machine runs), or start a local one on
    127.0.0.1 (no dashboard) when None."""
    import ray

    if address is None:
        for key, value in LOOPBACK_ENV.items():
            os.environ.setdefault(key, value)
        ray.init(num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False, _node_ip_address="127.0.0.1")
    else:
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        ray.init(address=address)
