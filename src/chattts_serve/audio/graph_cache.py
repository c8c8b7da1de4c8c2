"""The OpenVINO audio graphs (``audio.cpu_graph``, the ``ov-*`` audio dtypes) kept on disk between engine starts.

Building one is most of a CPU engine's start: for ``ov-int8`` a TorchScript trace of the Decoder + Vocos (2.0 s on
the full-size checkpoint, a 2-core Zen 4), then nncf's calibration and quantization (11.5 s) of a 20 s start; read
back from disk the same graph takes 0.03 s and compiles to the same bits. An entry is one directory: ``audio.xml``
+ ``audio.bin`` (``openvino.save_model``, weights as built) and ``manifest.json``. Its name is the key: a digest
of the checkpoint files the graph depends on (the Decoder and Vocos; for ``ov-int8`` also the GPT and the
embeddings its calibration runs), of this package's modules that build it, the runtime, ``FORMAT_VERSION`` and
the versions of the libraries that wrote it (torch traces it, OpenVINO converts it, nncf quantizes it). An entry
whose weights do not match the digest in its manifest, or that cannot be read, is built again and replaced;
entries are written whole or not at all (a temporary directory renamed into place).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..disk_cache import files_digest, publish

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
"""Bump when an entry's layout changes (an edit to the modules that build the graph changes the key by itself)."""
MANIFEST = "manifest.json"
GRAPH = "audio.xml"
WEIGHTS = "audio.bin"


def default_cache_dir() -> Path:
    import platformdirs

    return platformdirs.user_cache_path("chattts-serve", appauthor=False) / "openvino"


def _files(runtime: str) -> tuple[str, ...]:
    from ..models.chattts import checkpoint as ck

    audio = (ck.DECODER, ck.VOCOS)
    return (*audio, ck.GPT_CONFIG, ck.GPT_WEIGHTS, ck.EMBED) if runtime == "ov-int8" else audio


def _code(runtime: str) -> str:
    """A digest of this package's modules that make the graph (so an edited one never meets an old entry)."""
    package = Path(__file__).parent.parent  # read as files: importing cpu_graph here would be a cycle
    files = ["audio/cpu_graph.py", "models/chattts/dvae.py", "models/chattts/vocos.py"]
    if runtime == "ov-int8":
        files += ["audio/quantize.py", "models/chattts/gpt.py", "models/chattts/embed.py"]
    h = hashlib.sha256()
    for rel in files:
        h.update((package / rel).read_bytes())
    return h.hexdigest()[:16]


def _versions(runtime: str) -> dict[str, str]:
    import openvino
    import torch

    out = {"format": str(FORMAT_VERSION), "code": _code(runtime), "torch": torch.__version__}
    out["openvino"] = openvino.__version__
    if runtime == "ov-int8":
        import nncf

        from .quantize import INT8_KIND, SMOOTH_ALPHA

        out |= {"nncf": nncf.__version__, "int8": f"{INT8_KIND}-{SMOOTH_ALPHA}"}
    return out


def _digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def cache_key(root: Path, runtime: str) -> str:
    """The entry's directory name for ``runtime``'s graph of the checkpoint at ``root``."""
    h = hashlib.sha256(files_digest(root, _files(runtime)).encode())
    h.update(json.dumps(_versions(runtime), sort_keys=True).encode())
    return f"audio-{runtime}-{h.hexdigest()[:32]}"


def cached_graph(root: Path | None, runtime: str, build: Callable[[], Any], cache_dir: str | os.PathLike | None) -> Any:
    """``runtime``'s OpenVINO model of the checkpoint at ``root``: read from ``cache_dir``, or ``build()`` and
    stored there first (``cache_dir`` None, or ``root`` None for a model not loaded from files: built, not stored)."""
    if root is None or cache_dir is None:
        return build()
    import openvino as ov

    base = Path(cache_dir)
    key = cache_key(root, runtime)
    final = base / key
    if (final / MANIFEST).exists():
        try:
            # The weights against their digest first: a damaged file of the right size would load, and be wrong.
            want = json.loads((final / MANIFEST).read_text())["weights_sha256"]
            if _digest(final / WEIGHTS) != want:
                raise ValueError("its weights do not match their digest")
            graph = ov.Core().read_model(str(final / GRAPH))
            logger.info("audio graph (%s) from the cache: %s", runtime, final)
            return graph
        except Exception as exc:  # a damaged entry: built again below, and replaced
            logger.warning("audio graph cache entry %s unreadable (%s): building it again", final, exc)
    start = time.perf_counter()
    graph = build()
    try:
        _store(graph, final, runtime)
        logger.info("built the audio graph (%s) in %.1f s, cached in %s", runtime, time.perf_counter() - start, final)
    except OSError as exc:  # a read-only or full disk costs the next start its build, nothing else
        logger.warning("could not cache the audio graph in %s: %s", base, exc)
    return graph


def _store(graph: Any, final: Path, runtime: str) -> None:
    import openvino as ov

    def write(directory: Path) -> None:
        ov.save_model(graph, str(directory / GRAPH), compress_to_fp16=False)
        manifest = {"runtime": runtime, "files": list(_files(runtime)), **_versions(runtime)}
        manifest["weights_sha256"] = _digest(directory / WEIGHTS)
        (directory / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")

    publish(final, write, MANIFEST)
