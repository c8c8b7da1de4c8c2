"""What an ONNX export of the GPT trunk is on disk, and the key it is cached under.

An export is one directory: ``model.onnx`` (the graph, ``models.chattts.onnx_graph``), ``model.onnx.data`` (its
weights, fp32 or quantised by ``kernels.onnx_quant``) and ``manifest.json`` (``Manifest``: what it holds,
checked against the model when ``models.chattts.onnx_trunk`` loads it). ``models.chattts.onnx_export`` writes one, and
keeps one per ``cache_key`` in the user cache so that an engine start re-exports only when the
checkpoint, the weight kind, the graph format or ONNX Runtime changed.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from ...disk_cache import files_digest
from .checkpoint import GPT_CONFIG, GPT_WEIGHTS
from .config import GPTConfig

FORMAT_VERSION = 2
"""Bump when the graph changes: cached exports of older versions are then ignored."""
MANIFEST = "manifest.json"


@dataclass(frozen=True, slots=True)
class Manifest:
    """What an export holds; written next to ``model.onnx`` and checked when it is loaded."""

    format_version: int
    weights: str
    """fp32 | int8 | int4"""
    checkpoint_sha256: str
    """sha256 of the checkpoint's GPT weights and config (``checkpoint_digest``)."""
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_positions: int
    """Rows of the rotary tables: the largest cache position the graph can encode."""
    onnxruntime_version: str
    int8_reduce_range: bool = False
    """int8 weights use 7 bits (``int8_reduce_range``)."""

    @classmethod
    def read(cls, directory: Path) -> Manifest:
        path = Path(directory) / MANIFEST
        try:
            raw = json.loads(path.read_text())
            return cls(**raw)
        except (OSError, ValueError, TypeError) as exc:
            raise ValueError(f"{path}: not an ONNX export of chattts-serve ({exc})") from None

    def check(self, cfg: GPTConfig, weights: str) -> None:
        want = {
            "format_version": FORMAT_VERSION,
            "weights": weights,
            "hidden_size": cfg.hidden_size,
            "num_layers": cfg.num_layers,
            "num_heads": cfg.num_heads,
            "num_kv_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim,
        }
        got = asdict(self)
        diff = {k: (got[k], v) for k, v in want.items() if got[k] != v}
        if diff:
            raise ValueError(f"ONNX export does not fit this model: {diff} (found, wanted)")


def checkpoint_digest(root: Path) -> str:
    """sha256 over the GPT trunk's files (weights + config.json): what an export depends on."""
    return files_digest(root, (GPT_CONFIG, GPT_WEIGHTS))


def default_cache_dir() -> Path:
    import platformdirs

    return platformdirs.user_cache_path("chattts-serve", appauthor=False) / "onnx"


def cache_key(digest: str, weights: str, reduce_range: bool = False) -> str:
    """The cache directory's name for an export of the checkpoint with ``digest`` (``checkpoint_digest``)."""
    import onnxruntime

    # The ORT version is in the key because its quantizers write the int8/int4 graphs.
    tag = "int8r7" if weights == "int8" and reduce_range else weights
    return f"{digest[:32]}-{tag}-v{FORMAT_VERSION}-ort{onnxruntime.__version__}"
