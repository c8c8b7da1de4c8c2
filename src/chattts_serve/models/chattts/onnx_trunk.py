"""Run the exported GPT trunk (``models.chattts.onnx_export``) in ONNX Runtime over the engine's KV slot cache.

The cache is the same ``KVCache`` the torch path uses (``[layers, slots, kv_heads, capacity,
head_dim]``, fp32). Slots ``lo..hi`` of one layer are one contiguous block, so a step binds that block
as both ``past`` and ``present`` of the layer (I/O binding by pointer: no copy) and GroupQueryAttention
writes each row's new key/value in place at its own position. Rows of the block that have nothing to
do this step are idle (``query_seqlens = 0``): the op leaves their cache alone.

Providers: ``cpu`` (default on a CPU device), ``cuda`` and ``tensorrt`` (the cache and the embeddings
then live on that CUDA device and are bound there). GroupQueryAttention on CUDA runs in fp16/bf16
only, so the fp32 graph of this module would run it on the CPU: ``check_export`` refuses the GPU
providers unless ORT's profiler shows the node placed on them (a half-precision export is not written).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ...kernels.onnx_runtime import DATA_FILE, MODEL_FILE, require_onnxruntime
from .config import GPTConfig
from .gpt import KVCache
from .onnx_cache import Manifest

logger = logging.getLogger(__name__)

ONNX_PROVIDERS = ("auto", "cpu", "cuda", "tensorrt")
_PROVIDER_NAMES = {
    "cpu": ["CPUExecutionProvider"],
    "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"],
    "tensorrt": ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"],
}


def resolve_providers(provider: str, device: torch.device) -> list[str]:
    """ORT provider names for ``provider`` on ``device``; ValueError when they cannot run here."""
    import onnxruntime as ort

    if provider not in ONNX_PROVIDERS:
        raise ValueError(f"onnx provider must be one of {', '.join(ONNX_PROVIDERS)}; got {provider!r}")
    if provider == "auto":
        provider = "cuda" if device.type == "cuda" else "cpu"
    if (provider == "cpu") != (device.type == "cpu"):
        raise ValueError(f"onnx provider {provider!r} does not run on device {device.type!r}")
    names = _PROVIDER_NAMES[provider]
    available = ort.get_available_providers()
    if names[0] not in available:
        raise ValueError(
            f"ONNX Runtime here has no {names[0]} (available: {', '.join(available)}); "
            "install the onnxruntime build for it (e.g. onnxruntime-gpu)"
        )
    return names


@dataclass(frozen=True, slots=True)
class OpProfile:
    """What ORT's profiler recorded between ``start_op_profile`` and ``end_op_profile``; summed by op
    type in ``bench.ort_ops.op_seconds`` (reading it is the profiler's business, not the trunk's)."""

    events: list[dict]
    """ORT's profile: its JSON event list."""
    kinds: list[str]
    """Each run's kind, in order: "decode" (one position per row) or "prefill" (more)."""


MIN_ROWS = {"int4-b128": 2}
"""Calls narrower than this run with idle rows added: at one row MLAS's 4-bit kernel with blocks of 128 takes
another path (a GEMV) whose sums round differently (~5e-7) from the same row in a wider call, so a stream's codes
would depend on whether it decodes alone. From two rows on a row's result is the same whatever else is in the
call (``tests/models/chattts/test_onnx.py``). Block 32 computes one row as it computes many."""


class OnnxTrunk:
    """One ORT session of the trunk step; ``run`` prefills or decodes a contiguous block of slots."""

    def __init__(
        self,
        directory: str | Path,
        cfg: GPTConfig,
        weights: str,
        device: torch.device,
        provider: str = "auto",
        threads: int | None = None,
    ) -> None:
        require_onnxruntime()

        directory = Path(directory)
        self.directory = directory
        self.manifest = Manifest.read(directory)
        self.manifest.check(cfg, weights)
        self.cfg = cfg
        self.device = device
        self.threads = threads or torch.get_num_threads()
        """The same thread count as torch: the two never run at once (audio decode follows the step)."""
        self.providers = resolve_providers(provider, device)
        self.min_rows = MIN_ROWS.get(weights, 1)
        self.weight_bytes = sum(f.stat().st_size for f in (directory / MODEL_FILE, directory / DATA_FILE) if f.exists())
        """Bytes of the export's graph and weights: what one step reads, near enough (``profile``)."""
        self._device_type = "cuda" if device.type == "cuda" else "cpu"
        self._device_id = (device.index or 0) if device.type == "cuda" else 0
        self._run_kinds: list[str] | None = None
        """While ORT's profiler is on (``start_op_profile``): each run's kind, in order: "decode" for one
        position per row, "prefill" for more (a prompt is never one token)."""
        self._open_session()
        logger.info("ONNX trunk %s (%s) on %s", directory, weights, self.session.get_providers())

    def _open_session(self, profile_prefix: str | None = None) -> None:
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        so.intra_op_num_threads = self.threads
        so.inter_op_num_threads = 1
        so.log_severity_level = 3
        # ORT's workers spin between runs by default and then hold both cores while torch runs the heads,
        # sampling and audio decode: off, one stream's step went from ~30 to ~22 ms (BENCHMARKS.md).
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if profile_prefix is not None:
            so.enable_profiling = True
            so.profile_file_prefix = profile_prefix
        self.session = ort.InferenceSession(str(self.directory / MODEL_FILE), so, providers=self.providers)
        # Binding a block's 4 x layers cache buffers costs ~1-3 ms of Python per step; the cache never
        # moves, so each (cache, block) keeps its binding and a step rebinds only its inputs. A binding
        # belongs to its session.
        self._bindings: dict[tuple, object] = {}

    def start_op_profile(self, directory: str | Path) -> None:
        """Reopen the session with ORT's profiler on: every run from now on records each node's kernel
        time, until ``end_op_profile``. Reopening costs a model load (seconds): for ``profile``, not
        for serving."""
        self._open_session(profile_prefix=str(Path(directory) / "ort_profile"))
        self._run_kinds = []

    def end_op_profile(self) -> OpProfile:
        """Stop the profiler (the session runs on without it: no second model load) and return what it
        recorded of the runs since ``start_op_profile``."""
        if self._run_kinds is None:
            raise RuntimeError("end_op_profile without start_op_profile")
        path = Path(self.session.end_profiling())
        kinds, self._run_kinds = self._run_kinds, None
        try:
            events = json.loads(path.read_text())
        finally:
            path.unlink(missing_ok=True)
        return OpProfile(events, kinds)

    @property
    def max_positions(self) -> int:
        return self.manifest.max_positions

    def for_rows(self, rows: int) -> OnnxTrunk:
        """The session a call of ``rows`` matmul rows runs in: this one (``onnx_auto.AutoTrunk`` picks)."""
        return self

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        if max_len > self.max_positions:
            raise ValueError(f"cache of {max_len} positions exceeds the export's rotary table ({self.max_positions})")
        c = self.cfg
        return KVCache(c.num_layers, num_slots, c.num_kv_heads, max_len, c.head_dim, torch.float32, self.device)

    def _bind(self, io, name: str, t: torch.Tensor, output: bool = False) -> None:
        bind = io.bind_output if output else io.bind_input
        bind(name, self._device_type, self._device_id, np.float32, list(t.shape), t.data_ptr())

    def run(
        self,
        embeds: torch.Tensor,  # [B, S, hidden] fp32: row b is slot lo + b
        cache: KVCache,
        lo: int,
        seqlens_k: np.ndarray,  # [B] int32: positions cached after this step - 1
        query_seqlens: np.ndarray,  # [B] int32: new tokens of row b (0 = idle)
    ) -> torch.Tensor:
        """One step over slots ``lo .. lo + B - 1``; returns final-norm hidden states ``[B, S, hidden]``
        (rows and positions past ``query_seqlens`` are unspecified). Row b's new tokens go to cache
        positions ``seqlens_k[b] + 1 - query_seqlens[b] ..  seqlens_k[b]`` of its slot."""
        bsz = embeds.shape[0]
        if lo < 0 or lo + bsz > cache.num_slots:
            raise ValueError(f"slots {lo}..{lo + bsz - 1} outside the cache's {cache.num_slots}")
        if bsz < self.min_rows <= cache.num_slots:
            return self._run_widened(embeds, cache, lo, seqlens_k, query_seqlens)
        # The op wants total_sequence_length >= the call's width (a row padded past every real prompt).
        total = max(int(seqlens_k.max()) + 1, embeds.shape[1])
        if total > cache.max_len:
            raise ValueError(f"position {total - 1} exceeds cache {cache.max_len}")
        embeds = embeds.to(device=self.device, dtype=torch.float32).contiguous()
        out = torch.empty_like(embeds)
        io = self._cache_binding(cache, lo, bsz)
        self._bind(io, "embeds", embeds)
        io.bind_cpu_input("seqlens_k", np.ascontiguousarray(seqlens_k, dtype=np.int32))
        io.bind_cpu_input("total_sequence_length", np.array(total, dtype=np.int32))
        io.bind_cpu_input("query_seqlens", np.ascontiguousarray(query_seqlens, dtype=np.int32))
        self._bind(io, "hidden", out, output=True)
        if self._run_kinds is not None:
            self._run_kinds.append("decode" if embeds.shape[1] == 1 else "prefill")
        self.session.run_with_iobinding(io)
        return out

    def _run_widened(self, embeds, cache: KVCache, lo: int, seqlens_k: np.ndarray, query_seqlens: np.ndarray):
        """``run`` over ``min_rows`` slots: the call's rows, then idle neighbours (before them at the cache's
        end). Idle rows leave their slots' cache alone and cost next to nothing in a step that reads weights."""
        bsz = embeds.shape[0]
        start = min(lo, cache.num_slots - self.min_rows)
        at = lo - start  # the call's first row within the widened block
        wide = embeds.new_zeros((self.min_rows, *embeds.shape[1:]))
        wide[at : at + bsz] = embeds
        k, q = np.zeros(self.min_rows, np.int32), np.zeros(self.min_rows, np.int32)
        k[at : at + bsz], q[at : at + bsz] = seqlens_k, query_seqlens
        return self.run(wide, cache, start, k, q)[at : at + bsz]

    def _cache_binding(self, cache: KVCache, lo: int, bsz: int):
        """An I/O binding with slots ``lo .. lo + bsz - 1`` of ``cache`` bound as every layer's past and
        present (made once per block; keyed by the buffers' address and shape, which never change)."""
        key = (cache.k.data_ptr(), cache.v.data_ptr(), tuple(cache.k.shape), lo, bsz)
        io = self._bindings.get(key)
        if io is not None:
            return io
        if len(self._bindings) >= 4096:  # short-lived caches (``eval``) must not pile up
            self._bindings.clear()
        io = self.session.io_binding()
        for i in range(self.cfg.num_layers):
            # One layer's block of slots is contiguous in [layers, slots, ...]: bound by pointer,
            # past and present the same memory (GroupQueryAttention then appends in place).
            k, v = cache.k[i, lo : lo + bsz], cache.v[i, lo : lo + bsz]
            for kind, t in (("key", k), ("value", v)):
                self._bind(io, f"past_{kind}_{i}", t)
                self._bind(io, f"present_{kind}_{i}", t, output=True)
        self._bindings[key] = io
        return io


def check_export(directory: str | Path, cfg: GPTConfig, weights: str, provider: str = "cpu") -> None:
    """Load an export on ``provider`` and run one prefill and one decode step on random input;
    ValueError when it cannot load or its output is not finite. ``cuda``/``tensorrt`` are refused
    unless ORT has the provider and really runs GroupQueryAttention on it (``GPU_REFUSAL``)."""
    if provider != "cpu":
        _check_gpu_placement(directory, cfg, weights, provider)
        return
    trunk = OnnxTrunk(directory, cfg, weights, torch.device("cpu"), provider)
    prefill, decode = _two_steps(trunk, torch.device("cpu"))
    if not (torch.isfinite(prefill).all() and torch.isfinite(decode).all()):
        raise ValueError(f"the export in {directory} gives non-finite hidden states on {trunk.providers[0]}")


GPU_REFUSAL = (
    "--provider {provider} refused: {why}. The export is fp32, and ONNX Runtime's GroupQueryAttention has "
    "no fp32 CUDA kernel: ORT places it on the CPU, so a check would pass without running on the GPU. On a "
    "GPU use the torch path instead (--device cuda with --precision bf16 or fp16: CUDA graphs); the ort-* "
    "modes are CPU-only. The export in {directory} is written; --provider cpu checks it."
)
"""Why ``export onnx --provider cuda|tensorrt`` stops (exit 2): no "checked on cuda" that did not run there."""


def _check_gpu_placement(directory: str | Path, cfg: GPTConfig, weights: str, provider: str) -> None:
    import onnxruntime as ort

    def refuse(why: str) -> ValueError:
        return ValueError(GPU_REFUSAL.format(provider=provider, why=why, directory=directory))

    if provider not in _PROVIDER_NAMES:
        raise ValueError(f"onnx provider must be one of cpu, cuda, tensorrt; got {provider!r}")
    wanted = _PROVIDER_NAMES[provider][0]
    if wanted not in ort.get_available_providers():
        raise refuse(f"this ONNX Runtime has no {wanted} (available: {', '.join(ort.get_available_providers())})")
    if not torch.cuda.is_available():
        raise refuse("torch sees no CUDA device to bind the cache on")
    device = torch.device("cuda")
    try:
        placed = gqa_providers(OnnxTrunk(directory, cfg, weights, device, provider), device)
    except Exception as exc:  # a session or kernel that cannot run there is a refusal, not a crash
        raise refuse(f"ORT could not run the step on {wanted} ({exc})") from exc
    if placed != {wanted}:
        raise refuse(f"GroupQueryAttention ran on {', '.join(sorted(placed)) or 'no provider ORT reported'}")


def gqa_providers(trunk: OnnxTrunk, device: torch.device) -> set[str]:
    """The execution providers ORT ran the GroupQueryAttention nodes on during one prefill and one
    decode step (read from its profiler: the only record of where each node was placed)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        trunk.start_op_profile(tmp)
        try:
            _two_steps(trunk, device)
        finally:
            profile = trunk.end_op_profile()
    return {
        e.get("args", {}).get("provider", "")
        for e in profile.events
        if e.get("cat") == "Node" and e.get("args", {}).get("op_name") == "GroupQueryAttention"
    } - {""}


def _two_steps(trunk: OnnxTrunk, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """One prefill of 3 positions and one decode step on a fresh one-slot cache (random input)."""
    cache = trunk.new_cache(1, 8)
    x = torch.randn(1, 3, trunk.cfg.hidden_size, generator=torch.Generator().manual_seed(0)).to(device)
    prefill = trunk.run(x, cache, 0, np.array([2], np.int32), np.array([3], np.int32))
    decode = trunk.run(x[:, :1], cache, 0, np.array([3], np.int32), np.array([1], np.int32))
    return prefill, decode
