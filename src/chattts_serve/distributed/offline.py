"""Offline synthesis of job items: one engine over a list of items (the unit every path runs: one
process, one process per device, one Ray Data actor), and ``synthesize --input ... --devices a,b``: one
process per device over an equal share of the texts, without Ray (DataParallel would split each batch
over the cards; independent engines never wait on each other)."""

from __future__ import annotations

import logging
import math
import os
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

from ..engine.config import EngineConfig
from ..sampling_params import SamplingParams
from .jobs import Item, ManifestEntry, item_params, shard, write_wav_atomic

logger = logging.getLogger(__name__)


def synthesize_items(engine, items: list[Item], base: SamplingParams, out_dir: Path) -> list[ManifestEntry]:
    """Speak ``items`` in one batch and write ``<id>.wav`` for each. A text the engine refuses fails alone:
    the batch is then spoken item by item and the bad one gets an entry with its error and no file."""
    texts = [it.text for it in items]
    params = [item_params(base, it) for it in items]
    try:
        outcomes: list = engine.synthesize(texts, params)
    except ValueError:
        outcomes = []
        for text, p in zip(texts, params, strict=True):
            try:
                outcomes.append(engine.synthesize(text, p)[0])
            except ValueError as exc:
                outcomes.append(exc)
    entries = []
    for it, out in zip(items, outcomes, strict=True):
        if isinstance(out, Exception):
            entries.append(ManifestEntry(it.id, it.text, None, 0.0, it.seed, error=str(out)))
            continue
        write_wav_atomic(out_dir / it.file_name, out.audio, out.sample_rate)
        entries.append(ManifestEntry(it.id, it.text, it.file_name, round(out.duration, 4), it.seed))
    return entries


def _device_worker(
    device: str,
    model: str,
    config: EngineConfig,
    base: SamplingParams,
    items: list[Item],
    out_dir: str,
    threads: int,
    family: str | None,
) -> list[ManifestEntry]:
    import torch

    from ..device import bind_thread
    from ..engine.engine import Engine

    if threads:
        torch.set_num_threads(threads)
    # This thread's current device (0 unless set) is what calls that take no device use: the engine's.
    bind_thread(torch.device(device))
    engine = Engine.from_pretrained(model, device=device, config=config, family=family)
    return synthesize_items(engine, items, base, Path(out_dir))


def run_on_devices(
    devices: list[str],
    model: str,
    config: EngineConfig,
    base: SamplingParams,
    items: list[Item],
    out_dir: Path,
    family: str | None = None,
) -> list[ManifestEntry]:
    """One process per device (spawned: CUDA cannot be forked), each with its own engine over its share
    (``jobs.shard``); the entries in input order. CPU devices split the cores between them."""
    if not devices:
        raise ValueError("--devices needs at least one device")
    cpu_workers = sum(1 for d in devices if d == "cpu")
    threads = max(1, math.floor((os.cpu_count() or 1) / cpu_workers)) if cpu_workers else 0
    shares = shard(items, len(devices))
    ctx = get_context("spawn")
    with ProcessPoolExecutor(max_workers=len(devices), mp_context=ctx) as pool:
        futures = [
            pool.submit(
                _device_worker, d, model, config, base, share, str(out_dir), threads if d == "cpu" else 0, family
            )
            for d, share in zip(devices, shares, strict=True)
            if share
        ]
        by_id = {e.id: e for f in futures for e in f.result()}
    return [by_id[it.id] for it in items]
