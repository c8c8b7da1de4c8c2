"""The execution plan: every "auto" of an engine config resolved once, for one device and precision.

Why: the config leaves choices open ("auto": decode step, step graphs, KV dtype, sampling noise, audio
dtype, overlap, buckets) and each used to be settled where it was read, in seven places, so what an
engine ran was written down nowhere and two readers could settle one choice two ways. ``resolve_plan``
is the one function that reads them; the runner, its decode path (``engine.decode_path``), the noise
source and the audio stage take the plan's concrete values, and the plan is logged once at start
(``ExecutionPlan.describe``, one INFO line).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.quant import parse_precision
from .config import EngineConfig

DECODE_PATHS = ("rows", "static", "step-graph", "onnx")
"""The decode paths (``engine.decode_path``): one module each."""

_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True, slots=True)
class ExecutionPlan:
    """What one engine runs, every value concrete (no "auto")."""

    device: str
    """The device type: "cpu", "cuda", ..."""
    precision: str
    decode: str
    """One of ``DECODE_PATHS``: "rows" (per-row attention, batch-invariant), "static" (fixed shapes, the
    trunk in CUDA graphs), "step-graph" (the static trunk, heads and sampling as one graph) or "onnx"
    (the ``ort-*`` trunk in ONNX Runtime)."""
    kv_cache_dtype: torch.dtype
    sampling_noise: str
    """"generator" (reference-identical) or "counter" (``engine.noise``)."""
    cuda_graphs: bool
    """CUDA graphs are captured (on CUDA, ``cuda_graphs`` on): of the trunk ("static") or of the step."""
    strict_cuda_graphs: bool
    compile: bool
    audio_dtype: str
    """"fp32", "tf32" or "bf16" (``audio.decode``)."""
    audio_overlap: bool
    audio_buckets: bool

    @property
    def decode_mode(self) -> str:
        """The trunk step as the config and the benchmarks name it: "rows", "static" (the step graph runs
        the static step) or "onnx"."""
        return "static" if self.decode == "step-graph" else self.decode

    @property
    def trunk_graphs(self) -> bool:
        """The static trunk captures its own graphs: not under step graphs, whose replays run every decode
        step (the trunk's graphs would never replay)."""
        return self.cuda_graphs and self.decode == "static"

    def describe(self) -> str:
        on = {True: "on", False: "off"}
        return (
            f"execution plan: {self.device}, precision {self.precision}, decode {self.decode}, "
            f"kv cache {_DTYPE_NAMES.get(self.kv_cache_dtype, str(self.kv_cache_dtype))}, "
            f"noise {self.sampling_noise}, cuda graphs {on[self.cuda_graphs]}, compile {on[self.compile]}, "
            f"audio {self.audio_dtype} (overlap {on[self.audio_overlap]}, buckets {on[self.audio_buckets]})"
        )


def resolve_plan(config: EngineConfig, device_type: str) -> ExecutionPlan:
    """``config`` on a device type: the one place an "auto" is read. Raises ValueError for combinations
    that cannot run (step graphs "on" off the static step or with generator noise; a bf16 KV cache under
    an ``ort-*`` precision)."""
    rc = config.runner
    spec = parse_precision(config.precision)
    cuda = device_type == "cuda"
    noise = rc.sampling_noise if rc.sampling_noise != "auto" else ("counter" if cuda else "generator")
    if spec.onnx is not None:
        if rc.kv_cache_dtype == "bf16":
            raise ValueError("kv_cache_dtype bf16 is for the torch precisions; the ort-* cache is fp32")
        decode = "onnx"
    else:
        decode = rc.decode if rc.decode != "auto" else ("static" if cuda else "rows")
    graphs = rc.cuda_graphs and cuda
    possible = decode == "static" and noise == "counter"
    if rc.step_graphs == "on" and not possible:
        raise ValueError("step_graphs on needs decode static and sampling_noise counter")
    if possible and (rc.step_graphs == "on" or (rc.step_graphs == "auto" and graphs)):
        decode = "step-graph"
    audio_dtype = config.audio_dtype if config.audio_dtype != "auto" else ("bf16" if cuda else "fp32")
    return ExecutionPlan(
        device=device_type,
        precision=config.precision,
        decode=decode,
        kv_cache_dtype=torch.bfloat16 if rc.kv_cache_dtype == "bf16" else spec.trunk_dtype,
        sampling_noise=noise,
        cuda_graphs=graphs,
        strict_cuda_graphs=rc.strict_cuda_graphs,
        compile=rc.compile,
        audio_dtype=audio_dtype,
        audio_overlap=config.audio_overlap == "on" or (config.audio_overlap == "auto" and cuda),
        audio_buckets=config.audio_buckets == "on" or (config.audio_buckets == "auto" and cuda),
    )
