"""Tenants: API keys mapped to tenants, each with its own rate limit, concurrency cap and queue cap.

A tenants file (JSON) lists them:

    {"tenants": [
        {"name": "acme", "api_keys": ["sk-acme-1"], "max_concurrent": 8, "max_queued": 16,
         "rate_per_s": 2.0, "burst": 10, "max_voices": 50},
        {"name": "vip", "api_keys": ["sk-vip"], "dedicated": {"num_replicas": 2}}
    ]}

Limits hold per replica (each replica admits on its own, with no cross-replica round trip per request):
a tenant's cluster-wide concurrency is ``max_concurrent`` x replicas. A request over a limit is answered
429 with Retry-After (HTTP) or an error event and close 1013 (WebSocket), and never reaches the engine; a
request waiting in its tenant's queue holds no KV slot. ``dedicated`` tenants get their own Serve
application and replicas (see ``settings.plan_applications``).

Only synthesis (the routes tagged ``server.limits.synthesis``: speech, /v1/tts, the WebSocket) and other
costly work (tagged ``server.limits.limited``: creating a voice, an upload's decode and encode) are limited;
listing and reading voices, models, health and metrics are not. Saved voices belong to their tenant
(``server.voices``); ``max_voices`` caps a tenant's own (default: the server's ``--max-voices``, which holds
per tenant). Which tenant a request is comes from ``server.auth``, which resolved its key once
(``TenantsConfig.key_ring`` gives ``create_app`` the keys and their tenants).
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from starlette.middleware import Middleware

from ..server import auth
from ..server.limits import is_limited
from ..server.openapi import error_response

TENANT_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MIN_RATE_PER_S = 1e-6
"""The smallest rate limit (one request per ~11.6 days): below it the wait for a token is not a number."""
MAX_RETRY_AFTER_S = 86_400
"""Retry-After never says more than a day, whatever the wait computed."""


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    api_keys: tuple[str, ...]
    max_concurrent: int = 0
    """Requests of this tenant in flight on one replica; 0: no cap beyond the server's."""
    max_queued: int = 0
    """Requests that may wait for one of the tenant's concurrency slots (FIFO); beyond it: 429."""
    rate_per_s: float = 0.0
    """Requests admitted per second on one replica (token bucket); 0: no rate limit."""
    burst: int = 0
    """Bucket size: requests admitted at once after a quiet spell; 0: max(1, ceil(rate_per_s))."""
    max_voices: int = 0
    """Saved voices the tenant may have; 0: the server's ``--max-voices`` (which holds per tenant)."""
    dedicated: dict[str, Any] | None = None
    """Own replicas: {"num_replicas": N} or {"autoscale": "MIN:MAX"}; None: the shared deployment."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not TENANT_NAME.fullmatch(self.name):
            raise ValueError(f"tenant name must be 1-64 of [A-Za-z0-9_-], got {self.name!r}")
        if not self.api_keys or not all(isinstance(k, str) and k.strip() for k in self.api_keys):
            raise ValueError(f"tenant {self.name!r} needs at least one non-empty API key")
        for name in ("max_concurrent", "max_queued", "burst", "max_voices"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"tenant {self.name!r}: {name} must be an int >= 0, got {value!r}")
        rate = self.rate_per_s
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate) or rate < 0:
            raise ValueError(f"tenant {self.name!r}: rate_per_s must be a number >= 0, got {rate!r}")
        if 0 < rate < MIN_RATE_PER_S:  # a wait of 1/rate seconds overflows (1e-320: infinite)
            raise ValueError(f"tenant {self.name!r}: rate_per_s must be 0 (off) or >= {MIN_RATE_PER_S:g}, got {rate!r}")
        if self.dedicated is not None and (
            not isinstance(self.dedicated, dict) or not set(self.dedicated) <= {"num_replicas", "autoscale"}
        ):
            raise ValueError(
                f"tenant {self.name!r}: dedicated must be {{'num_replicas': N}} or {{'autoscale': 'MIN:MAX'}}, "
                f"got {self.dedicated!r}"
            )

    @property
    def bucket_size(self) -> int:
        return self.burst or max(1, math.ceil(self.rate_per_s))


@dataclass(frozen=True, slots=True)
class TenantsConfig:
    tenants: tuple[Tenant, ...] = ()

    def __post_init__(self) -> None:
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names):
            raise ValueError(f"tenant names must be unique, got {names}")
        keys = [k for t in self.tenants for k in t.api_keys]
        if len(set(keys)) != len(keys):
            raise ValueError("an API key belongs to more than one tenant")

    @classmethod
    def from_dict(cls, data: Any) -> TenantsConfig:
        if not isinstance(data, dict) or not isinstance(data.get("tenants"), list) or set(data) != {"tenants"}:
            raise ValueError('a tenants config is {"tenants": [{"name": ..., "api_keys": [...], ...}, ...]}')
        known = {f.name for f in fields(Tenant)}
        tenants = []
        for i, entry in enumerate(data["tenants"]):
            if not isinstance(entry, dict):
                raise ValueError(f"tenants[{i}] must be an object, got {type(entry).__name__}")
            unknown = set(entry) - known
            if unknown:
                raise ValueError(f"tenants[{i}]: unknown field(s) {', '.join(sorted(unknown))}")
            keys = entry.get("api_keys")
            if isinstance(keys, str) or not isinstance(keys, (list, tuple)):
                raise ValueError(f"tenants[{i}].api_keys must be a list of strings")
            tenants.append(Tenant(**{**entry, "api_keys": tuple(keys)}))
        return cls(tuple(tenants))

    @classmethod
    def load(cls, path: str | Path) -> TenantsConfig:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read the tenants file {path}: {exc}") from None
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        out = []
        for t in self.tenants:
            entry = {f.name: getattr(t, f.name) for f in fields(Tenant)}
            entry["api_keys"] = list(t.api_keys)
            out.append(entry)
        return {"tenants": out}

    @property
    def api_keys(self) -> tuple[str, ...]:
        return tuple(k for t in self.tenants for k in t.api_keys)

    def subset(self, names: tuple[str, ...]) -> TenantsConfig:
        return TenantsConfig(tuple(t for t in self.tenants if t.name in names))

    def key_ring(self) -> auth.KeyRing:
        """The keys ``server.auth`` accepts: only these tenants' keys, each with its tenant."""
        return auth.KeyRing.from_tenants({t.name: t.api_keys for t in self.tenants})


class TenantLimited(Exception):
    """A request over its tenant's limit. ``reason``: rate, concurrency or queue_wait."""

    def __init__(self, tenant: str, reason: str, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.tenant, self.reason, self.retry_after_s = tenant, reason, retry_after_s


class TokenBucket:
    """``rate`` tokens per second up to ``size``; starts full."""

    def __init__(self, rate: float, size: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.size, self.clock = rate, size, clock
        self.tokens = float(size)
        self.stamp = clock()

    def take(self) -> float:
        """0.0 when a token was taken, else the seconds until one will be there."""
        now = self.clock()
        self.tokens = min(self.size, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate


@dataclass(eq=False)
class TenantGate:
    """One tenant's admission on this replica: rate first, then a concurrency slot, waiting (FIFO, at most
    ``max_queued`` requests, at most ``max_wait_s``) when none is free. Runs on one event loop."""

    tenant: Tenant
    max_wait_s: float
    clock: Callable[[], float] = time.monotonic
    in_flight: int = 0
    waiters: deque = field(default_factory=deque)
    bucket: TokenBucket | None = None

    def __post_init__(self) -> None:
        if self.tenant.rate_per_s > 0:
            self.bucket = TokenBucket(self.tenant.rate_per_s, self.tenant.bucket_size, self.clock)

    @property
    def num_queued(self) -> int:
        return len(self.waiters)

    async def acquire(self) -> None:
        t = self.tenant
        if self.bucket is not None:
            wait = self.bucket.take()
            if wait > 0:
                raise TenantLimited(t.name, "rate", f"tenant {t.name!r} is over {t.rate_per_s:g} requests/s", wait)
        if not t.max_concurrent or self.in_flight < t.max_concurrent:
            self.in_flight += 1
            return
        if len(self.waiters) >= t.max_queued:
            raise TenantLimited(
                t.name,
                "concurrency",
                f"tenant {t.name!r} has {self.in_flight} requests in flight and {len(self.waiters)} queued "
                f"(its limits: {t.max_concurrent} and {t.max_queued}); retry shortly",
                1.0,
            )
        waiter = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), self.max_wait_s)
        except (asyncio.TimeoutError, TimeoutError, asyncio.CancelledError) as exc:
            if waiter.done() and not waiter.cancelled():  # the slot was handed over just now: give it back
                self.release()
            else:
                waiter.cancel()
                self.waiters.remove(waiter)
            if not isinstance(exc, asyncio.CancelledError):
                raise TenantLimited(
                    t.name, "queue_wait", f"tenant {t.name!r}: no free slot within {self.max_wait_s:g} s", 1.0
                ) from None
            raise
        # The releasing request handed its slot over: in_flight already counts this one.

    def release(self) -> None:
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes to the first waiter; in_flight stays
                return
        self.in_flight -= 1


class TenantMetrics:
    """Per-tenant series in the app's Prometheus registry (so they show on /metrics and are re-exported
    per replica like every other series). The gauges are read from the gates at scrape time."""

    def __init__(self, registry, gates: dict[str, TenantGate]) -> None:
        from prometheus_client import Counter

        self.gates = gates
        self.requests = Counter(
            "chattts_tenant_requests",
            "Limited requests (synthesis, voice creation) by tenant and outcome",
            ["tenant", "status"],
            registry=registry,
        )
        self.rejected = Counter(
            "chattts_tenant_rejected_requests",
            "Requests refused for a tenant limit",
            ["tenant", "reason"],
            registry=registry,
        )
        for name in gates:  # every tenant's series exists from the start (a scrape sees zeros, not gaps)
            self.requests.labels(name, "admitted")
        registry.register(self)

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        in_flight = GaugeMetricFamily("chattts_tenant_requests_in_flight", "Admitted requests", labels=["tenant"])
        queued = GaugeMetricFamily("chattts_tenant_requests_queued", "Requests waiting for a slot", labels=["tenant"])
        for name, gate in self.gates.items():
            in_flight.add_metric([name], gate.in_flight)
            queued.add_metric([name], gate.num_queued)
        return [in_flight, queued]


class TenantLimits:
    """ASGI middleware: each limited request (synthesis, voice creation: ``server.limits.is_limited``) takes its
    tenant's limits (rate, concurrency, queue) for its whole life, the streamed body included, and carries the
    tenant's voice cap (``scope["state"]["max_voices"]``, when it sets one). Placed inside
    ``server.auth.Authenticate``, whose principal names the tenant; a limited request without one of these
    tenants (an app built without ``key_ring``'s keys) is refused as a bad key, never served unlimited."""

    def __init__(self, app, config: TenantsConfig, max_wait_s: float, clock: Callable[[], float] = time.monotonic):
        self.app, self.config = app, config
        self.gates = {t.name: TenantGate(t, max_wait_s, clock) for t in config.tenants}
        self.metrics: TenantMetrics | None = None

    def _metrics(self, scope) -> TenantMetrics | None:
        if self.metrics is None:
            state = getattr(scope.get("app"), "state", None)
            registry = getattr(getattr(state, "metrics", None), "registry", None)
            if registry is not None:
                self.metrics = TenantMetrics(registry, self.gates)
        return self.metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or not is_limited(scope):
            return await self.app(scope, receive, send)
        who = auth.principal(scope)
        gate = self.gates.get(who.tenant) if who is not None and who.authorized and who.tenant else None
        if gate is None:
            return await auth.refuse(scope, receive, send)
        tenant, metrics = gate.tenant, self._metrics(scope)
        try:
            await gate.acquire()
        except TenantLimited as exc:
            if metrics is not None:
                metrics.rejected.labels(tenant.name, exc.reason).inc()
                metrics.requests.labels(tenant.name, "rejected").inc()
            return await _refuse(scope, receive, send, exc)
        state = scope.setdefault("state", {})
        state["tenant"] = tenant.name
        if tenant.max_voices:
            state["max_voices"] = tenant.max_voices
        if metrics is not None:
            metrics.requests.labels(tenant.name, "admitted").inc()
        try:
            await self.app(scope, receive, send)
        finally:
            gate.release()


def replica_app_options(tenants: TenantsConfig | None, max_wait_s: float) -> dict[str, Any]:
    """``create_app``'s keyword arguments for an app serving ``tenants``: only their keys are accepted,
    each naming its tenant, and each synthesis request is under its tenant's limits (none: no tenants)."""
    if tenants is None:
        return {}
    return {"middleware": [Middleware(TenantLimits, config=tenants, max_wait_s=max_wait_s)], "keys": tenants.key_ring()}


async def _refuse(scope, receive, send, exc: TenantLimited) -> None:
    wait = exc.retry_after_s if math.isfinite(exc.retry_after_s) else MAX_RETRY_AFTER_S
    retry_after = str(max(1, math.ceil(min(wait, MAX_RETRY_AFTER_S))))
    code = "tenant_rate_limited" if exc.reason == "rate" else "tenant_capacity"
    if scope["type"] == "websocket":
        # As the WebSocket route answers its own capacity errors: an error event, then 1013 (try again later).
        message = await receive()
        if message["type"] != "websocket.connect":
            return
        await send({"type": "websocket.accept"})
        event = {"type": "error", "message": str(exc), "code": code, "fatal": True, "retry_after_s": int(retry_after)}
        await send({"type": "websocket.send", "text": json.dumps(event)})
        await send({"type": "websocket.close", "code": 1013})
        return
    response = error_response(429, str(exc), "rate_limit_error", code=code, headers={"Retry-After": retry_after})
    await response(scope, receive, send)
