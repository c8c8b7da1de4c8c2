"""``chattts-serve ray serve|batch``: the flags, and what each command runs. ray is imported only when a
command runs (the base install has no ray; ``pip install 'chattts-serve[ray]'``)."""

from __future__ import annotations

import argparse
import functools
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..engine.config import add_max_num_seqs_argument
from .settings import PROXY_ONLY_LIMITS, proxy_only_refusal

logger = logging.getLogger(__name__)


def add_arguments(
    p: argparse.ArgumentParser,
    *,
    server_args: Callable[[argparse.ArgumentParser], None],
    model_args: Callable[[argparse.ArgumentParser], None],
    sampling_args: Callable[[argparse.ArgumentParser], None],
    sampling_flags: tuple[str, ...],
) -> None:
    """``ray``'s subcommands; the flag groups they share with ``serve`` and ``synthesize`` come in as the
    functions that add them there (``sampling_flags``: the names ``sampling_args`` adds)."""
    sub = p.add_subparsers(dest="ray_command", required=True)
    srv = sub.add_parser("serve", help="serve on Ray Serve: N replicas of the server, one engine each")
    server_args(srv)
    for action in srv._actions:  # parsed, to be refused by name (serve_settings), but not offered
        if action.dest in PROXY_ONLY_LIMITS:
            action.help = argparse.SUPPRESS
    _cluster_args(srv)
    srv.add_argument("--name", default="chattts", help="application and deployment name (default: chattts)")
    srv.add_argument("--num-replicas", type=int, default=1, help="replicas (default: 1; see --autoscale)")
    srv.add_argument("--autoscale", metavar="MIN:MAX", help="autoscale between MIN and MAX replicas")
    srv.add_argument("--target-ongoing-requests", type=float, help="autoscaling target per replica (default: KV slots)")
    srv.add_argument("--upscale-delay-s", type=float, default=30.0)
    srv.add_argument("--downscale-delay-s", type=float, default=600.0)
    srv.add_argument("--autoscaling-config", type=json.loads, default={}, help="more Serve autoscaling_config (JSON)")
    srv.add_argument(
        "--max-ongoing-requests",
        type=int,
        help="requests Ray sends a replica at once (default: 2x slots + tenants' max_queued + --websocket-sessions)",
    )
    srv.add_argument(
        "--websocket-sessions",
        type=int,
        default=16,
        help="open WebSockets a replica takes beyond its working requests (Ray counts each as ongoing; default: 16)",
    )
    srv.add_argument("--num-cpus-per-replica", type=float, default=1.0)
    srv.add_argument("--num-gpus-per-replica", type=float, help="default: 1 when the cluster has GPUs, else 0")
    srv.add_argument("--max-memory-fraction", type=float, help="CUDA: share of the device per replica (KV slots fit)")
    srv.add_argument("--tenants", help="tenants file (JSON): API keys -> tenants with limits (docs/ray.md)")
    srv.add_argument("--recycle-after-requests", type=int, default=0, help="replace a replica after N requests")
    srv.add_argument("--recycle-max-rss-mb", type=int, default=0, help="replace a replica whose RSS passes this")
    srv.add_argument(
        "--recycle-max-cuda-mb", type=int, default=0, help="replace a replica whose CUDA memory passes this"
    )
    srv.add_argument("--health-check-period-s", type=float, default=5.0)
    srv.add_argument("--metrics-period-s", type=float, default=5.0, help="how often replicas export to Ray metrics")
    srv.set_defaults(func=_serve)

    bat = sub.add_parser("batch", help="offline synthesis on Ray Data: one WAV per text + manifest.jsonl")
    bat.add_argument(
        "--input", required=True, help="texts: .txt (one per line), .jsonl or .parquet (text, id, seed, voice, options)"
    )
    bat.add_argument("--output-dir", required=True, help="WAVs and manifest.jsonl (shared storage on a cluster)")
    bat.add_argument("--num-workers", type=int, default=1, help="actors, each with one engine (one GPU if any)")
    add_max_num_seqs_argument(bat, default=16, note=" per engine")
    bat.add_argument(
        "--rows-per-batch",
        type=int,
        default=None,
        help="texts Ray Data hands an engine at a time (default: --max-num-seqs, so each batch fills the slots)",
    )
    bat.add_argument("--num-cpus-per-worker", type=float, default=1.0)
    bat.add_argument("--no-progress", dest="progress", action="store_false")
    _cluster_args(bat)
    model_args(bat)
    from ..models import names

    bat.add_argument("--family", choices=names(), help="the model family (default: detected from --model)")
    bat.set_defaults(device="auto")
    sampling_args(bat)
    bat.set_defaults(func=functools.partial(_batch, sampling_flags=sampling_flags))


def _cluster_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", help="join this Ray cluster ('auto': the one on this machine); default: start one")
    p.add_argument("--num-cpus", type=int, help="CPUs of the local cluster this command starts (default: all)")


def serve_settings(args: argparse.Namespace):
    """The ServeSettings of ``ray serve``'s flags; the server options resolved here (flags, then this
    machine's CHATTTS_SERVE_*, then defaults) and sent to every replica as they are. The ``PROXY_ONLY_LIMITS``
    are refused as flags; from the environment (which ``serve`` may share) they are ignored with a warning."""
    import os

    from ..server.config import ENV_PREFIX, ServerConfig
    from .recycling import RecyclePolicy
    from .settings import ServeSettings, parse_autoscale
    from .tenants import TenantsConfig

    if flags := ["--" + name.replace("_", "-") for name in PROXY_ONLY_LIMITS if getattr(args, name, None) is not None]:
        raise ValueError(proxy_only_refusal(flags))
    if env := [ENV_PREFIX + name.upper() for name in PROXY_ONLY_LIMITS if ENV_PREFIX + name.upper() in os.environ]:
        logger.warning("ignored on Ray Serve: %s (%s)", ", ".join(env), proxy_only_refusal(env))
    config = ServerConfig.from_args(args)
    server: dict[str, Any] = config.to_flat()
    for name in PROXY_ONLY_LIMITS:  # not the replicas' to enforce (settings.PROXY_ONLY_LIMITS)
        del server[name]
    server["voices_db"] = config.voices.path  # one file for every replica (see docs/ray.md for clusters)
    if args.tenants:
        server.pop("api_keys")
    mb = 2**20
    return ServeSettings(
        server=server,
        name=args.name,
        num_replicas=args.num_replicas,
        autoscale=parse_autoscale(args.autoscale) if args.autoscale else None,
        target_ongoing_requests=args.target_ongoing_requests,
        max_ongoing_requests=args.max_ongoing_requests,
        websocket_sessions=args.websocket_sessions,
        upscale_delay_s=args.upscale_delay_s,
        downscale_delay_s=args.downscale_delay_s,
        autoscaling_extra=args.autoscaling_config,
        num_cpus=args.num_cpus_per_replica,
        num_gpus=args.num_gpus_per_replica,
        max_memory_fraction=args.max_memory_fraction,
        tenants=TenantsConfig.load(args.tenants) if args.tenants else None,
        recycle=RecyclePolicy(
            max_requests=args.recycle_after_requests,
            max_rss_bytes=args.recycle_max_rss_mb * mb,
            max_cuda_bytes=args.recycle_max_cuda_mb * mb,
        ),
        health_check_period_s=args.health_check_period_s,
        metrics_period_s=args.metrics_period_s,
    )


def _serve(args: argparse.Namespace) -> int:
    settings = serve_settings(args)
    from ..server.auth import KeyRing, open_to_anyone
    from .serve_app import serve_forever

    config = settings.server_config()
    keys = KeyRing.from_keys(config.api_keys) if settings.tenants is None else KeyRing(by_tenant=True)
    if warning := open_to_anyone(config.host, keys):
        logger.warning(warning)

    return serve_forever(settings, args.address, num_cpus=args.num_cpus)


def _batch(args: argparse.Namespace, sampling_flags: tuple[str, ...]) -> int:
    from ..engine.config import EngineConfig, engine_config_from_args
    from ..models.flags import with_family_options
    from ..sampling_params import SamplingParams
    from .jobs import read_items, with_seed

    base = SamplingParams.from_options(**{name: getattr(args, name) for name in sampling_flags})
    base = with_family_options(base, args)  # the families' own flags (models.flags), checked against the model
    items = with_seed(read_items(args.input), base.seed)
    rows_per_batch = args.rows_per_batch if args.rows_per_batch is not None else args.max_num_seqs
    if rows_per_batch < 1:
        raise ValueError(f"--rows-per-batch must be >= 1, got {rows_per_batch}")
    config = engine_config_from_args(args, EngineConfig())
    from .cluster import connect
    from .ray_batch import run_batch

    connect(args.address, num_cpus=args.num_cpus)
    import ray

    try:
        summary = run_batch(
            items,
            Path(args.output_dir),
            model=args.model,
            config=config,
            base=base,
            num_workers=args.num_workers,
            rows_per_batch=rows_per_batch,
            device=args.device,
            family=args.family,
            num_cpus_per_worker=args.num_cpus_per_worker,
            progress=args.progress,
        )
    finally:
        ray.shutdown()
    print(json.dumps(summary))
    return 1 if summary["failed"] else 0
