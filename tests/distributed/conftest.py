"""A real local Ray cluster on 127.0.0.1 for the Ray test modules: one per module (``ray_cluster``), shut
down with everything it started. The ``chattts-serve ray ...`` commands under test join it with
``--address``, as a user joins a running cluster."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from ..server.conftest import free_port

RAY_ENV = {
    # Loopback only: without this Ray binds the machine's external address (shared/reference/ray-notes.md).
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    # Short intervals, so metrics and autoscaling decisions arrive within a test's patience.
    "RAY_metrics_report_interval_ms": "1000",
    "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
    "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
    "RAY_DEDUP_LOGS": "0",
}


# Ray reads some of these when it is imported: set them before any test imports it.
for _key, _value in RAY_ENV.items():
    os.environ.setdefault(_key, _value)


@dataclass
class RayCluster:
    address: str
    metrics_port: int


@contextmanager
def ray_cluster(num_cpus: int = 2) -> Iterator[RayCluster]:
    ray = pytest.importorskip("ray", reason="needs the .[ray] extra")
    metrics_port = free_port()
    try:
        ray.init(
            num_cpus=num_cpus,
            include_dashboard=False,
            object_store_memory=256 * 2**20,
            _node_ip_address="127.0.0.1",
            _metrics_export_port=metrics_port,
            log_to_driver=False,
        )
        yield RayCluster(ray.get_runtime_context().gcs_address, metrics_port)
    finally:
        ray.shutdown()


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "chattts_serve.cli", *args]


@contextmanager
def background(cmd: list[str], log_path: Path) -> Iterator[subprocess.Popen]:
    """A command running for the block; SIGTERM (then SIGKILL) after."""
    log = open(log_path, "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **RAY_ENV, "OMP_NUM_THREADS": "1"}
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        log.close()


def wait_for(predicate, timeout: float, what: str, interval: float = 0.25, log: Path | None = None):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-3000:] if log is not None and log.exists() else ""
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}\n{tail}")
        time.sleep(interval)


@contextmanager
def served_on_ray(tmp: Path, root: Path) -> Iterator[str]:
    """``chattts-serve ray serve`` of the checkpoint at ``root`` (its family detected from its files) on a fresh
    local cluster: one replica behind Serve's HTTP proxy on 127.0.0.1; yields the proxy's base URL."""
    port = free_port()
    with ray_cluster() as cluster:
        cmd = cli(
            "ray", "serve", "--address", cluster.address, "--model", str(root), "--host", "127.0.0.1",
            "--port", str(port), "--num-replicas", "1", "--num-cpus-per-replica", "0.5", "--threads", "1",
            "--voices-db", str(tmp / "voices.sqlite3"), "--log-level", "warning",
        )  # fmt: skip
        log = tmp / "ray-serve.log"
        with background(cmd, log) as proc:

            def ready() -> bool:
                assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
                return "serving " in log.read_text(errors="replace")

            wait_for(ready, 240, "the application", log=log)
            yield f"http://127.0.0.1:{port}"
