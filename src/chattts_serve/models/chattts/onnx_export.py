"""Writing an ONNX export of the GPT trunk (the ``ort-*`` precisions): the graph (``models.chattts.onnx_graph``),
its weights quantised (``kernels.onnx_quant``), saved with its manifest (``models.chattts.onnx_cache``), either
into a given directory (``export``, the ``export onnx`` command) or into the user cache, once per key
(``cached_export``, what an engine start uses).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from ...disk_cache import publish
from ...kernels.onnx_quant import int8_reduce_range, quantize
from ...kernels.onnx_runtime import DATA_FILE, MODEL_FILE, WEIGHT_KINDS, require_onnxruntime, save_model
from .checkpoint import LoadedModel
from .onnx_cache import FORMAT_VERSION, MANIFEST, Manifest, cache_key, checkpoint_digest, default_cache_dir
from .onnx_graph import build_graph

logger = logging.getLogger(__name__)


def export(
    model: LoadedModel,
    out: str | os.PathLike,
    weights: str = "fp32",
    digest: str | None = None,
    reduce_range: bool | None = None,
) -> Path:
    """Write the trunk of ``model`` (fp32, as loaded) as an ONNX export to directory ``out``:
    ``model.onnx`` + ``model.onnx.data`` + ``manifest.json``. Returns ``out``. ``reduce_range``: 7-bit
    int8 weights (None: ``int8_reduce_range()`` for this CPU; ignored for fp32 and int4)."""
    require_onnxruntime()
    import onnxruntime

    if weights not in WEIGHT_KINDS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHT_KINDS)}; got {weights!r}")
    reduce_range = int8_reduce_range() if reduce_range is None else reduce_range
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name in (MANIFEST, MODEL_FILE, DATA_FILE):  # onnx appends to an existing data file
        (out / name).unlink(missing_ok=True)
    cfg = model.config.gpt
    start = time.perf_counter()
    graph = build_graph(model.gpt)
    if weights == "fp32":
        save_model(graph, out)
    else:
        with tempfile.TemporaryDirectory(dir=out) as tmp:
            save_model(graph, Path(tmp))
            del graph
            quantize(Path(tmp), out, weights, reduce_range)
    manifest = Manifest(
        format_version=FORMAT_VERSION,
        weights=weights,
        checkpoint_sha256=digest or checkpoint_digest(model.root),
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_positions=cfg.max_position_embeddings,
        onnxruntime_version=onnxruntime.__version__,
        int8_reduce_range=weights == "int8" and reduce_range,
    )
    (out / MANIFEST).write_text(json.dumps(asdict(manifest), indent=2) + "\n")
    logger.info("exported the GPT trunk (%s) to %s in %.1f s", weights, out, time.perf_counter() - start)
    return out


def cached_export(model: LoadedModel, weights: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """The export of ``model``'s trunk with ``weights``, from the cache (``cache_dir``, default the user
    cache dir) or written there first. Keyed by the checkpoint's digest, the weight kind, the graph
    format and the ONNX Runtime version, so an engine start re-exports only when one of them changed."""
    require_onnxruntime()
    base = Path(cache_dir) if cache_dir else default_cache_dir()
    digest = checkpoint_digest(model.root)
    reduce_range = weights == "int8" and int8_reduce_range()
    final = base / cache_key(digest, weights, reduce_range)
    if (final / MANIFEST).exists():
        logger.info("ONNX export from the cache: %s", final)
        return final
    publish(final, lambda directory: export(model, directory, weights, digest, reduce_range), MANIFEST)
    return final
