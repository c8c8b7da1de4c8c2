"""chattts-serve on Ray Serve: one deployment whose replicas each own one engine and are themselves the
HTTP ingress, serving the app ``server.app.create_app`` builds (the same routes as ``chattts-serve
serve``: OpenAI speech with streaming and SSE, /v1/tts, the WebSocket, voices, health, metrics).

    chattts-serve ray serve --model DIR --num-replicas 2     # starts (or, with --address, joins) a cluster
    serve deploy deploy/ray-serve.yaml    # import_path: chattts_serve.distributed.serve_app:app; also KubeRay

``app`` is a Serve application builder: its ``args`` are ``ServeSettings`` fields (``settings.py``).
Streams leave the replica as they are made; a client that disconnects cancels the replica's request task,
and the route's cleanup aborts the engine request (as in one process). Voices live in one SQLite file that
every replica opens (``server.voices_db``; see docs/ray.md for clusters). Each replica's Prometheus series
are re-exported as Ray metrics tagged with the replica (``metrics_export``). ``check_health`` fails when the
engine loop died or the recycling policy tripped; Ray then replaces the replica after it drained.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from dataclasses import replace
from typing import Any

import ray
from ray import serve
from starlette.datastructures import MutableHeaders

from ..server.app import create_app
from ..server.config import resolve_device
from ..server.limits import is_synthesis
from .cluster import connect
from .memory import cap_device_memory
from .metrics_export import RayMetricsMirror
from .recycling import Recycler
from .settings import ServeSettings, plan_applications, threads_per_replica
from .tenants import replica_app_options

logger = logging.getLogger(__name__)

REPLICA_HEADER = "X-Chattts-Replica"
"""Response header naming the replica that answered (``<replica id>/<pid>``): logs and debugging."""


class ReplicaContext:
    """ASGI middleware (outermost): names the replica in every response and counts synthesis requests
    for the recycling policy."""

    def __init__(self, app, replica: str, recycler: Recycler) -> None:
        self.app, self.replica, self.recycler = app, replica.encode(), recycler

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)

        async def named(message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[REPLICA_HEADER] = self.replica.decode()
            elif message["type"] == "websocket.accept":
                headers = [*message.get("headers", []), (REPLICA_HEADER.lower().encode(), self.replica)]
                message = {**message, "headers": headers}
            await send(message)

        counted = is_synthesis(scope)
        if counted:
            self.recycler.started()
        try:
            await self.app(scope, receive, named)
        finally:
            if counted:
                self.recycler.finished()


@serve.deployment
@serve.ingress()
class ChatTTSReplica:
    """One replica: one engine, one app. ``settings``: ``ServeSettings.to_dict()``."""

    async def __init__(self, settings: dict[str, Any]) -> None:
        import torch

        self.settings = ServeSettings.from_dict(settings)
        config = self.settings.server_config()
        threads = threads_per_replica(self.settings)
        torch.set_num_threads(threads)
        device = resolve_device(config.device)
        engine = await asyncio.to_thread(
            cap_device_memory, config.model, config.engine, device, self.settings.max_memory_fraction
        )
        self.config = replace(config, device=device, threads=threads, engine=engine)
        context = serve.get_replica_context()
        self.replica = f"{context.replica_id.unique_id}/{os.getpid()}"
        self.recycler = Recycler(self.settings.recycle)
        options = replica_app_options(self.settings.served_tenants, self.config.timeouts.queue_wait_s)
        self.asgi = create_app(self.config, **options)
        self.asgi.add_middleware(ReplicaContext, replica=self.replica, recycler=self.recycler)
        self._mirror = asyncio.get_running_loop().create_task(self._export_metrics())

    def __serve_build_asgi_app__(self):
        return self.asgi  # (``self.app`` is Serve's: the wrapper's property)

    async def _export_metrics(self) -> None:
        from ray.serve.metrics import Gauge

        mirror = None
        while True:
            await asyncio.sleep(self.settings.metrics_period_s)
            metrics = getattr(self.asgi.state, "metrics", None)
            if metrics is None:  # the lifespan (model load) has not finished yet
                continue
            if mirror is None:
                mirror = RayMetricsMirror(
                    metrics.registry, lambda name, doc, keys: Gauge(name, description=doc, tag_keys=keys)
                )
            try:
                mirror.sync()
            except Exception:  # metrics must never take a replica down
                logger.exception("exporting metrics to Ray failed")

    async def check_health(self) -> None:
        engine = getattr(self.asgi.state, "engine", None)
        if engine is not None and engine.dead_error is not None:
            raise RuntimeError(f"the engine loop has stopped: {engine.dead_error}")
        tripped = self.recycler.reason is not None
        reason = self.recycler.check()
        if reason is not None:
            if not tripped:  # once: Ray calls this every health_check_period_s until it acts
                logger.warning(
                    "replica %s asks to be replaced: %s (%d in flight)", self.replica, reason, self.recycler.in_flight
                )
            raise RuntimeError(f"recycling this replica: {reason}")

    async def __del__(self) -> None:
        mirror = getattr(self, "_mirror", None)  # absent when __init__ failed
        if mirror is not None:
            mirror.cancel()


def bind(settings: ServeSettings, cluster_gpus: float):
    """The bound application of one ``ServeSettings`` (one deployment)."""
    options = settings.deployment_options(cluster_gpus)
    return ChatTTSReplica.options(**options).bind(settings.to_dict())


def app(args: dict[str, Any] | None = None):
    """Serve application builder (``import_path: chattts_serve.distributed.serve_app:app``); ``args``:
    ``ServeSettings`` fields. Builds one application; a dedicated tenant's application is a second entry
    in the Serve config with ``serve_tenants: [name]`` (see deploy/ray-serve.yaml)."""
    settings = ServeSettings.from_dict(dict(args or {}))
    settings.server_config()  # fails here, not in every replica, when the app would serve no tenant
    return bind(settings, ray.cluster_resources().get("GPU", 0))


def deploy(settings: ServeSettings) -> list[ServeSettings]:
    """Start Serve (HTTP on the settings' host and port) and deploy every application of ``settings``
    together; returns them once every one is running (its replicas loaded and warmed up)."""
    serve.start(http_options=settings.http_options())
    gpus = ray.cluster_resources().get("GPU", 0)
    plans = plan_applications(settings)
    targets = [serve.RunTarget(bind(p, gpus), name=p.name, route_prefix=p.route_prefix) for p in plans]
    serve.run_many(targets)
    return plans


class _Stop(BaseException):
    """SIGINT or SIGTERM in ``serve_forever``: leave what it is doing (deploying or waiting) and tear down."""


def _stop_on_signals() -> None:
    def stop(*_) -> None:
        raise _Stop

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)


def serve_forever(settings: ServeSettings, address: str | None, num_cpus: int | None = None) -> int:
    """``chattts-serve ray serve``: deploy, print where each application listens, wait for SIGINT or
    SIGTERM (also while deploying), then delete the applications (and stop Serve and the local cluster if
    this process started it) and return 0."""
    _stop_on_signals()
    try:
        try:
            connect(address, num_cpus=num_cpus)
            # Again: ray.init installs its own SIGTERM handler (a local head node's prints and exits 1
            # without deleting the applications), over ours.
            _stop_on_signals()
            plans = deploy(settings)
            http = settings.http_options()
            for plan in plans:
                print(f"serving {plan.name} on http://{http['host']}:{http['port']}{plan.route_prefix}", flush=True)
            while True:
                time.sleep(3600)
        except _Stop:
            pass
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the teardown short
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C still can
        logger.info("stopping: deleting the applications")
        if ray.is_initialized():
            for plan in plan_applications(settings):
                with contextlib.suppress(Exception):
                    serve.delete(plan.name)
            if address is None:
                with contextlib.suppress(Exception):
                    serve.shutdown()
    finally:
        ray.shutdown()
    return 0
