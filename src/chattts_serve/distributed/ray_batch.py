"""``chattts-serve ray batch``: offline synthesis on Ray Data. The items become a Dataset; ``map_batches``
runs them through an actor pool (``ActorPoolStrategy(size=N)``), each actor holding one engine (one GPU
each when the cluster has GPUs); each actor writes ``<id>.wav`` into the output directory and returns the
manifest entries, which the driver appends to ``manifest.jsonl`` as batches finish. A rerun skips every id
already in the manifest with its file (``jobs.pending``). Same items and seeds, same files as
``chattts-serve synthesize --input`` (the engine's output does not depend on what it is batched with).

On a cluster the output directory must be shared storage that every node mounts at the same path.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

import ray
from ray.data import ActorPoolStrategy

from ..engine.config import EngineConfig
from ..sampling_params import SamplingParams
from ..server.config import resolve_device
from .jobs import Item, ManifestEntry, append_manifest, pending
from .offline import synthesize_items

logger = logging.getLogger(__name__)

NO_SEED = -1
"""A seed column needs one type; -1 stands for "no seed" (seeds are >= 0)."""


def to_row(item: Item) -> dict:
    """An item as a Dataset row: one type per column (no seed -1, no voice ""), the options as JSON text (each
    item may name other options: one struct column would give every row every key)."""
    seed, options = NO_SEED if item.seed is None else item.seed, json.dumps(item.options)
    return {"id": item.id, "text": item.text, "seed": seed, "voice": item.voice or "", "options": options}


def from_row(i, t, s, v, o) -> Item:
    """``to_row`` undone, from a numpy batch's values."""
    return Item(str(i), str(t), None if int(s) == NO_SEED else int(s), str(v) or None, json.loads(str(o)))


class SynthesizeBatch:
    """A Ray Data actor: one engine, loaded once, then batch after batch."""

    def __init__(
        self,
        model: str,
        device: str,
        config: EngineConfig,
        base: SamplingParams,
        out_dir: str,
        threads: int,
        family: str | None = None,
    ) -> None:
        import torch

        from ..engine.engine import Engine

        torch.set_num_threads(threads)
        self.engine = Engine.from_pretrained(model, device=resolve_device(device), config=config, family=family)
        self.base, self.out_dir = base, Path(out_dir)

    def __call__(self, batch: dict) -> dict:
        columns = (batch["id"], batch["text"], batch["seed"], batch["voice"], batch["options"])
        items = [from_row(*values) for values in zip(*columns, strict=True)]
        entries = synthesize_items(self.engine, items, self.base, self.out_dir)
        return {
            "id": [e.id for e in entries],
            "text": [e.text for e in entries],
            "file": [e.file or "" for e in entries],
            "duration": [e.duration for e in entries],
            "seed": [NO_SEED if e.seed is None else e.seed for e in entries],
            "error": [e.error or "" for e in entries],
        }


def run_batch(
    items: list[Item],
    out_dir: Path,
    *,
    model: str,
    config: EngineConfig,
    base: SamplingParams,
    num_workers: int,
    rows_per_batch: int,
    device: str = "auto",
    family: str | None = None,
    num_cpus_per_worker: float = 1.0,
    progress: bool = True,
) -> dict:
    """Run the job on the connected cluster; returns a summary (done, skipped, failed, audio seconds)."""
    if num_workers < 1:
        raise ValueError(f"--num-workers must be >= 1, got {num_workers}")
    out_dir.mkdir(parents=True, exist_ok=True)
    todo = pending(items, out_dir)
    summary = {"total": len(items), "skipped": len(items) - len(todo), "done": 0, "failed": 0, "audio_s": 0.0}
    if not todo:
        return summary
    gpus = ray.cluster_resources().get("GPU", 0) > 0
    rows = [to_row(it) for it in todo]
    # One block per batch, so the pool's actors share the work from the start.
    ds = ray.data.from_items(rows, override_num_blocks=max(1, math.ceil(len(rows) / rows_per_batch)))
    threads = max(1, math.floor(num_cpus_per_worker))
    out = ds.map_batches(
        SynthesizeBatch,
        fn_constructor_kwargs={
            "model": model,
            "device": ("cuda" if gpus else "cpu") if device == "auto" else device,
            "config": config,
            "base": base,
            "out_dir": str(out_dir),
            "threads": threads,
            "family": family,
        },
        compute=ActorPoolStrategy(size=num_workers),
        batch_size=rows_per_batch,
        num_gpus=1 if gpus else 0,
        num_cpus=num_cpus_per_worker,
    )
    from tqdm import tqdm

    start = time.perf_counter()
    with tqdm(total=len(todo), desc="ray batch", unit="text", disable=not progress) as bar:
        for batch in out.iter_batches(batch_size=None, batch_format="numpy"):
            entries = [
                ManifestEntry(
                    str(i), str(t), str(f) or None, float(d), None if int(s) == NO_SEED else int(s), str(e) or None
                )
                for i, t, f, d, s, e in zip(
                    batch["id"],
                    batch["text"],
                    batch["file"],
                    batch["duration"],
                    batch["seed"],
                    batch["error"],
                    strict=True,
                )
            ]
            append_manifest(out_dir, entries)
            for e in entries:
                if e.error:
                    summary["failed"] += 1
                    logger.error("%s failed: %s", e.id, e.error)
                else:
                    summary["done"] += 1
                    summary["audio_s"] += e.duration
            bar.update(len(entries))
    summary["wall_s"] = time.perf_counter() - start
    return summary
