"""``ServeSettings``: everything a Ray Serve deployment of chattts-serve is made of, as plain data (the CLI
builds it from flags, ``serve_app.app`` from a Serve config's ``args``), and the pure functions that turn
it into Serve's deployment options and applications. No ray import here.

Sizing rules (why the numbers are what they are):

* ``max_ongoing_requests`` (what Ray's router sends one replica at once; Ray's default of 5 would starve
  continuous batching): twice the KV slots (one batch decoding and one waiting inside the engine, so a
  slot that frees is refilled at the next step instead of a router round trip later), plus what holds a
  place without using a slot: the served tenants' ``max_queued`` (a request waiting for its tenant's
  slot is ongoing for Ray) and ``websocket_sessions`` (a WebSocket is ongoing for as long as it is open,
  idle or not). Without those, one tenant's queue or a few idle sockets would fill the replica for Ray,
  and every other request would wait in Serve's router, where no limit of ours answers it.
* autoscaling ``target_ongoing_requests``: the KV slots: scale out when a replica's slots are full on
  average.
* ``graceful_shutdown_timeout_s``: the longest request (``max_audio_seconds`` of audio, generated at
  real-time speed or better) plus a margin, so a replica being replaced finishes its streams.

Connection limits: Serve's HTTP proxy (plain uvicorn) takes only host, port, keep-alive and request
timeouts (``http_options``). The request body cap and deadline (``max_body_bytes``, ``body_timeout_s``),
the WebSocket message cap (``ws_max_message_bytes``) and every session limit hold inside each replica's
app. ``PROXY_ONLY_LIMITS`` cannot: Serve's proxy accepts any number of connections, waits for headers
forever and buffers WebSocket messages up to 16 MiB; a proxy in front (docs/ray.md) enforces those.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any

from ..server.config import ServerConfig
from .recycling import RecyclePolicy
from .tenants import TenantsConfig

DEFAULT_NAME = "chattts"
PROXY_ONLY_LIMITS = ("max_connections", "header_timeout_s")
"""Server options a replica cannot enforce behind Serve's proxy (see the module doc); a WebSocket
message is also buffered whole by the proxy, up to its own 16 MiB, before a replica can refuse it. Setting
one is refused (``proxy_only_refusal``): accepted, it would say a limit holds that does not."""
TENANT_ROUTE_PREFIX = "/tenants/"


def proxy_only_refusal(names: list[str]) -> str:
    """Why ray serve refuses the ``PROXY_ONLY_LIMITS`` options ``names`` (as the caller spells them)."""
    return (
        f"ray serve cannot enforce {', '.join(names)}: Serve's HTTP proxy accepts any number of connections "
        "and waits for request headers forever. Leave them out and put a proxy in front that caps connections "
        'and sets a header timeout (docs/ray.md, "Limits and keys")'
    )


def parse_autoscale(value: str) -> tuple[int, int]:
    """``"MIN:MAX"`` -> (min, max) replicas."""
    try:
        low, high = (int(x) for x in str(value).split(":"))
    except ValueError:
        raise ValueError(f"autoscale must be MIN:MAX replicas (e.g. 1:4), got {value!r}") from None
    if not 0 <= low <= high or high < 1:
        raise ValueError(f"autoscale needs 0 <= MIN <= MAX and MAX >= 1, got {value!r}")
    return low, high


@dataclass(frozen=True, slots=True)
class ServeSettings:
    server: dict[str, Any] = field(default_factory=dict)
    """ServerConfig's flat options, server and engine (the names of ``chattts-serve serve``'s flags with
    underscores: ``port``, ``send_timeout_s``, ``ws_max_text_chars``, ``max_num_seqs``, ...)."""
    name: str = DEFAULT_NAME
    """Deployment name (and application name)."""
    route_prefix: str = "/"
    num_replicas: int = 1
    autoscale: tuple[int, int] | None = None
    """(min, max) replicas; None: a fixed ``num_replicas``."""
    target_ongoing_requests: float | None = None
    """Autoscaling target per replica; None: the KV slots."""
    max_ongoing_requests: int | None = None
    """Requests Ray sends one replica at once; None: twice the KV slots + tenants' queues + WebSockets."""
    websocket_sessions: int = 16
    """Open WebSocket sessions a replica takes beyond its working requests (see the module doc)."""
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    autoscaling_extra: dict[str, Any] = field(default_factory=dict)
    """Further Serve ``autoscaling_config`` fields (look_back_period_s, ...), passed as they are."""
    num_cpus: float = 1.0
    """CPUs Ray reserves per replica (and its torch threads when ``server.threads`` is 0)."""
    num_gpus: float | None = None
    """GPUs per replica; None: 1 when the cluster has GPUs, else 0."""
    max_memory_fraction: float | None = None
    """CUDA only: the share of its device a replica may allocate; KV slots are sized to fit inside."""
    tenants: TenantsConfig | None = None
    serve_tenants: tuple[str, ...] | None = None
    """The tenants this application serves (None: every tenant not ``dedicated``)."""
    recycle: RecyclePolicy = field(default_factory=RecyclePolicy)
    health_check_period_s: float = 5.0
    metrics_period_s: float = 5.0
    """How often a replica copies its Prometheus series into Ray's metrics."""
    graceful_shutdown_timeout_s: float | None = None
    """None: the longest request (see the module doc)."""

    def __post_init__(self) -> None:
        if not isinstance(self.num_replicas, int) or self.num_replicas < 1:
            raise ValueError(f"num_replicas must be an int >= 1, got {self.num_replicas!r}")
        if not self.route_prefix.startswith("/"):
            raise ValueError(f"route_prefix must start with '/', got {self.route_prefix!r}")
        if self.max_ongoing_requests is not None and self.max_ongoing_requests < 1:
            raise ValueError(f"max_ongoing_requests must be >= 1, got {self.max_ongoing_requests!r}")
        if isinstance(self.websocket_sessions, bool) or not isinstance(self.websocket_sessions, int):
            raise ValueError(f"websocket_sessions must be an int >= 0, got {self.websocket_sessions!r}")
        if self.websocket_sessions < 0:
            raise ValueError(f"websocket_sessions must be an int >= 0, got {self.websocket_sessions!r}")
        if self.server.get("wyoming_uri") or self.server.get("wyoming_zeroconf"):
            raise ValueError(
                "ray serve does not serve Wyoming: every replica would bind the same port, and the protocol has "
                "no authentication; run `chattts-serve wyoming` (or `serve --wyoming-uri`) on a trusted host"
            )
        if self.max_memory_fraction is not None and not 0 < self.max_memory_fraction <= 1:
            raise ValueError(f"max_memory_fraction must be in (0, 1], got {self.max_memory_fraction!r}")
        for name in ("num_cpus", "health_check_period_s", "metrics_period_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if given := [name for name in PROXY_ONLY_LIMITS if name in self.server]:
            raise ValueError(proxy_only_refusal(given))
        unknown = set(self.server) - set(ServerConfig.flat_defaults())
        if unknown:
            raise ValueError(f"unknown server option(s): {', '.join(sorted(unknown))}")
        if self.tenants is not None and self.server.get("api_keys"):
            raise ValueError("give API keys either as api_keys or in the tenants config, not both")
        # Every server option is checked here, in the driver, not in each replica.
        ServerConfig.from_flat(**self._server_options())

    # ------------------------------------------------------------------ from and to plain data

    @classmethod
    def from_dict(cls, args: dict[str, Any]) -> ServeSettings:
        """From a Serve config's ``args`` (or ``serve run ... key=value``): this dataclass's fields, with
        ``server`` a dict, ``autoscale`` "MIN:MAX", ``tenants`` a dict or the path of a JSON file,
        ``recycle`` a dict of ``RecyclePolicy`` fields."""
        known = {f.name for f in fields(cls)}
        unknown = set(args) - known
        if unknown:
            raise ValueError(f"unknown setting(s): {', '.join(sorted(unknown))}; known: {', '.join(sorted(known))}")
        values = dict(args)
        if isinstance(values.get("autoscale"), str):
            values["autoscale"] = parse_autoscale(values["autoscale"])
        elif values.get("autoscale") is not None:
            values["autoscale"] = tuple(values["autoscale"])
        tenants = values.get("tenants")
        if isinstance(tenants, str):
            values["tenants"] = TenantsConfig.load(tenants)
        elif isinstance(tenants, dict):
            values["tenants"] = TenantsConfig.from_dict(tenants)
        if isinstance(values.get("recycle"), dict):
            values["recycle"] = RecyclePolicy(**values["recycle"])
        if values.get("serve_tenants") is not None:
            values["serve_tenants"] = tuple(values["serve_tenants"])
        for name in ("num_replicas", "max_ongoing_requests", "websocket_sessions"):
            if isinstance(values.get(name), str):
                values[name] = int(values[name])
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (lists, dicts, numbers): what a replica receives and ``from_dict`` reads back."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, TenantsConfig):
                value = value.to_dict()
            elif isinstance(value, RecyclePolicy):
                value = {g.name: getattr(value, g.name) for g in fields(RecyclePolicy)}
            elif isinstance(value, tuple):
                value = list(value)
            elif isinstance(value, dict):
                value = {k: list(v) if isinstance(v, tuple) else v for k, v in value.items()}
            out[f.name] = value
        return out

    # ------------------------------------------------------------------ what the replicas run

    @property
    def served_tenants(self) -> TenantsConfig | None:
        if self.tenants is None:
            return None
        if self.serve_tenants is not None:
            return self.tenants.subset(self.serve_tenants)
        return TenantsConfig(tuple(t for t in self.tenants.tenants if t.dedicated is None))

    def server_config(self) -> ServerConfig:
        """The replicas' ServerConfig: the given options over the defaults (no environment: a replica
        on another node must not read that node's CHATTTS_SERVE_*), API keys from the tenants."""
        options = self._server_options()
        served = self.served_tenants
        if served is not None:
            if not served.tenants:
                raise ValueError(f"application {self.name!r} serves no tenant (every tenant has its own)")
            options["api_keys"] = served.api_keys
        return ServerConfig.from_flat(**options)

    def _server_options(self) -> dict[str, Any]:
        return {k: tuple(v) if isinstance(v, list) else v for k, v in self.server.items()}

    @property
    def max_num_seqs(self) -> int:
        """The KV slots of each replica's engine."""
        return self.server_config().engine.scheduler.max_num_seqs

    @property
    def default_max_ongoing_requests(self) -> int:
        """Twice the KV slots, plus the served tenants' queues and the WebSocket allowance (module doc)."""
        served = self.served_tenants
        queued = sum(t.max_queued for t in served.tenants if t.max_concurrent) if served is not None else 0
        return 2 * self.max_num_seqs + queued + self.websocket_sessions

    def deployment_options(self, cluster_gpus: float) -> dict[str, Any]:
        """Serve's deployment options (``serve.deployment(...).options(**these)``)."""
        slots = self.max_num_seqs
        gpus = self.num_gpus if self.num_gpus is not None else (1.0 if cluster_gpus > 0 else 0.0)
        config = self.server_config()
        longest_s = config.engine.max_audio_seconds
        options: dict[str, Any] = {
            "name": self.name,
            "max_ongoing_requests": self.max_ongoing_requests or self.default_max_ongoing_requests,
            "ray_actor_options": {"num_cpus": self.num_cpus, "num_gpus": gpus},
            "health_check_period_s": self.health_check_period_s,
            "health_check_timeout_s": max(30.0, 2 * self.health_check_period_s),
            "graceful_shutdown_wait_loop_s": 1.0,
            "graceful_shutdown_timeout_s": self.graceful_shutdown_timeout_s or longest_s + 60.0,
        }
        if self.autoscale is None:
            options["num_replicas"] = self.num_replicas
        else:
            low, high = self.autoscale
            options["autoscaling_config"] = {
                "min_replicas": low,
                "max_replicas": high,
                "initial_replicas": max(low, 1),
                "target_ongoing_requests": self.target_ongoing_requests or slots,
                "upscale_delay_s": self.upscale_delay_s,
                "downscale_delay_s": self.downscale_delay_s,
                **self.autoscaling_extra,
            }
        return options

    def http_options(self) -> dict[str, Any]:
        """Serve's proxy options: all that Serve lets us set (``PROXY_ONLY_LIMITS`` need a proxy in front)."""
        config = self.server_config()
        # Streams last as long as their audio: no proxy timeout (the app has its own send timeout and
        # audio cap); keep-alive as ``chattts-serve serve`` has it (server.run.uvicorn_config).
        return {"host": config.host, "port": config.port, "request_timeout_s": None, "keep_alive_timeout_s": 5}


def plan_applications(settings: ServeSettings) -> list[ServeSettings]:
    """One Serve application per deployment: the shared one at ``settings.route_prefix`` (every tenant not
    dedicated; left out when there is none), and one per ``dedicated`` tenant at ``/tenants/<name>`` with
    its own replicas. Each has its own name (also its deployment's name)."""
    if settings.tenants is None:
        return [settings]
    shared = settings.served_tenants
    plans = [settings] if shared is not None and shared.tenants else []
    for t in settings.tenants.tenants:
        if t.dedicated is None:
            continue
        sizing: dict[str, Any] = {"num_replicas": int(t.dedicated.get("num_replicas", 1)), "autoscale": None}
        if "autoscale" in t.dedicated:
            sizing["autoscale"] = parse_autoscale(t.dedicated["autoscale"])
        plans.append(
            replace(
                settings,
                name=f"{settings.name}-{t.name}",
                route_prefix=TENANT_ROUTE_PREFIX + t.name,
                serve_tenants=(t.name,),
                **sizing,
            )
        )
    return plans


def threads_per_replica(settings: ServeSettings) -> int:
    """torch threads in a replica: ``server.threads`` if set, else its reserved CPUs (at least 1)."""
    return int(settings.server.get("threads") or max(1, math.floor(settings.num_cpus)))
