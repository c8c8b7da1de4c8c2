"""The execution plan: every "auto" of an engine config resolved once, for one device and precision.

Why: the config leaves choices open ("auto": decode step, step graphs, KV dtype, sampling noise, the
static step's attention kernel, the host one step ahead, audio dtype, overlap, buckets, graphs) and each
used to be settled where it was read, in seven places, so what an engine ran was written down nowhere
and two readers could settle one choice two ways. ``resolve_plan`` is the one function that reads them;
the runner, its decode path (``engine.decode_path``), the engine core (host ahead), the noise source and
the audio stage take the plan's concrete values, and the plan is logged once at start
(``ExecutionPlan.describe``, one INFO line).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cpu import probe
from ..kernels import decode_attention, flex_decode
from ..kernels.quant import parse_precision
from .config import AUDIO_GRAPH_DTYPES, EngineConfig

DECODE_PATHS = ("rows", "static", "step-graph", "onnx")
"""The decode paths (``engine.decode_path``): one module each."""

PREFILL_BLOCK = 64
"""Chunked prefill's alignment: chunks of a prompt are multiples of this many positions, the torch prefill
attention's query block (``engine.prefill_runner``: what makes a chunked prompt's result its one-shot one). Small
enough to cut a step's budget finely, large enough that the extra attention calls cost little."""

PREFILL_CHUNKS = {"rows": True, "static": True, "step-graph": True, "onnx": True}
"""Whether each decode path's ``prefill`` takes prompt chunks (the torch prefill and ONNX Runtime's
GroupQueryAttention both append a chunk after the cached positions). A path that cannot says False here, and its
engines prefill whole prompts (``ExecutionPlan.prefill_chunk`` 0)."""

_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int8: "int8"}
_KV_DTYPES = {"bf16": torch.bfloat16, "int8": torch.int8}
"""``--kv-cache-dtype`` other than auto (the trunk's dtype)."""


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
    attention: str
    """The static step's decode attention (``kernels.flex_decode``): "flex" (each row reads its own keys:
    CUDA's default where its probe runs) or "sdpa" (the context bucket under a mask)."""
    host_ahead: bool
    """The host schedules and queues step n+1 before it reads step n's tokens (``engine.core``)."""
    audio_dtype: str
    """"fp32", "tf32" or "bf16" (``audio.decode``), or a CPU graph runtime (``audio.cpu_graph``)."""
    audio_overlap: bool
    audio_buckets: bool
    audio_graphs: bool
    """Decoder + Vocos as CUDA graphs per window bucket (``audio.graphs``): CUDA with overlap and buckets."""
    audio_threads: int = 1
    """A CPU audio worker's torch threads (``audio.overlap.ThreadStreams``; see ``resolve_plan``)."""
    prefill_chunk: int = PREFILL_BLOCK
    """The decode path takes prompt chunks of multiples of this many positions (``PREFILL_BLOCK``), or 0: it
    does not. The engine's scheduler chunks with it where more than one slot is (``chunked_prefill``)."""

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
        worker = f" on {self.audio_threads} thread(s)" if self.audio_overlap and self.device == "cpu" else ""
        return (
            f"execution plan: {self.device}, precision {self.precision}, decode {self.decode}, "
            f"kv cache {_DTYPE_NAMES.get(self.kv_cache_dtype, str(self.kv_cache_dtype))}"
            f"{' + fp32 scales' if self.kv_cache_dtype == torch.int8 else ''}, "
            f"noise {self.sampling_noise}, cuda graphs {on[self.cuda_graphs]}, compile {on[self.compile]}, "
            f"attention {self.attention}, host ahead {on[self.host_ahead]}, audio {self.audio_dtype} "
            f"(overlap {on[self.audio_overlap]}{worker}, buckets {on[self.audio_buckets]}, "
            f"graphs {on[self.audio_graphs]}), "
            f"prefill chunks {self.prefill_chunk or 'off'}"
        )

    def chunked_prefill(self, num_slots: int) -> int:
        """``SchedulerConfig.prefill_chunk`` for an engine of ``num_slots`` slots: this plan's, but 0 with one slot,
        where nothing decodes beside a prompt (nothing to interleave) and the prompt's attention stays the one call
        the reference makes (fp32 with one slot is bit-exact with it)."""
        return self.prefill_chunk if num_slots > 1 else 0


def resolve_audio_dtype(requested: str, device_type: str) -> str:
    """``--audio-dtype`` on a device, for every family that decodes audio in torch: "auto" is bf16 on CUDA and
    fp32 elsewhere; the graph dtypes (ONNX Runtime, OpenVINO) run on the CPU only."""
    audio_dtype = requested if requested != "auto" else ("bf16" if device_type == "cuda" else "fp32")
    if audio_dtype in AUDIO_GRAPH_DTYPES and device_type != "cpu":
        raise ValueError(f"audio_dtype {audio_dtype} runs on the CPU only; on {device_type} use bf16, tf32 or fp32")
    return audio_dtype


def resolve_plan(config: EngineConfig, device_type: str) -> ExecutionPlan:
    """``config`` on a device type: the one place an "auto" is read. Raises ValueError for combinations
    that cannot run (step graphs "on" off the static step or with generator noise; a bf16 or int8 KV cache
    under an ``ort-*`` precision; an int8 KV cache off the CPU; an ONNX Runtime / OpenVINO audio graph off the
    CPU)."""
    rc = config.runner
    spec = parse_precision(config.precision)
    cuda = device_type == "cuda"
    noise = rc.sampling_noise if rc.sampling_noise != "auto" else ("counter" if cuda else "generator")
    if spec.onnx is not None:
        if rc.kv_cache_dtype != "auto":
            raise ValueError(f"kv_cache_dtype {rc.kv_cache_dtype} is for the torch precisions; the ort-* cache is fp32")
        decode = "onnx"
    else:
        decode = rc.decode if rc.decode != "auto" else ("static" if cuda else "rows")
    graphs = rc.cuda_graphs and cuda
    possible = decode == "static" and noise == "counter"
    if rc.step_graphs == "on" and not possible:
        raise ValueError("step_graphs on needs decode static and sampling_noise counter")
    if possible and (rc.step_graphs == "on" or (rc.step_graphs == "auto" and graphs)):
        decode = "step-graph"
    if rc.kv_cache_dtype == "int8" and device_type != "cpu":
        # Its attention is a CPU op; CUDA's static step would dequantize whole context buckets every layer.
        raise ValueError(f"kv_cache_dtype int8 runs on the CPU only; on {device_type} use bf16")
    kv_dtype = _KV_DTYPES.get(rc.kv_cache_dtype, spec.trunk_dtype)
    if rc.kv_cache_dtype == "auto" and spec.cpu_kv_dtype is not None and device_type == "cpu":
        # (int4: int8) a fraction of the cache's bytes where the C++ decode attention reads them; elsewhere
        # such a cache would run torch's far slower SDPA over dequantised rows.
        if decode_attention.cpu_supported():
            kv_dtype = spec.cpu_kv_dtype
    # The static step on CUDA: FlexAttention where its probe runs (``CHATTTS_CUDA_ATTENTION`` may force
    # either; the probe runs once a process). Off CUDA the masked SDPA unless forced.
    attention = flex_decode.choose(device_type, kv_dtype) if decode in ("static", "step-graph") else "sdpa"
    audio_dtype = resolve_audio_dtype(config.audio_dtype, device_type)
    # On a CPU the overlapped decode runs on a worker thread beside the trunk: it needs a core of the engine's
    # own beside the engine thread's. torch's thread count is the engine's share of the machine (a replica of
    # several on one box gets 1): with 2 or more, auto overlaps (BENCHMARKS.md: 8 % off the ragged offline
    # wall, 4-12 % off one stream's RTF on 2 cores; no loss where the audio has nothing to overlap with).
    # Windows made beside a step that uses every core (int4's wide steps: ``DecodePath.audio_beside``) are
    # decoded after it on the engine thread instead.
    engine_threads = torch.get_num_threads()
    overlap = config.audio_overlap == "on" or (
        config.audio_overlap == "auto" and (cuda or (device_type == "cpu" and engine_threads >= 2))
    )
    buckets = config.audio_buckets == "on" or (config.audio_buckets == "auto" and cuda)
    # The worker's torch threads. Beside a trunk on OpenMP (torch's ops, the int4 C++ step) no more than the
    # cores the engine thread leaves (at least 1): libgomp counts the threads of every team in the process, and
    # once they outnumber the cores its idle threads sleep at once at every barrier, so each of the trunk's
    # parallel regions pays a wake-up for the rest of the process (int4, 32 rows, 2 cores: the step 30 ms with
    # a 1-thread worker, 42-50 ms with 2). ONNX Runtime's trunk runs on its own pool: the worker keeps the
    # engine's count there (ort-int8, 32 streams: 7.4x real time with 2 worker threads, 6.4x with 1).
    audio_threads = (
        engine_threads if spec.onnx is not None else max(1, min(engine_threads, probe().cores - engine_threads))
    )
    return ExecutionPlan(
        device=device_type,
        precision=config.precision,
        decode=decode,
        kv_cache_dtype=kv_dtype,
        sampling_noise=noise,
        cuda_graphs=graphs,
        strict_cuda_graphs=rc.strict_cuda_graphs,
        compile=rc.compile,
        attention=attention,
        host_ahead=config.host_ahead == "on" or (config.host_ahead == "auto" and cuda),
        audio_dtype=audio_dtype,
        audio_overlap=overlap,
        audio_buckets=buckets,
        # Captured on the audio stream (overlap) over repeating shapes (buckets); "on" elsewhere: off.
        audio_graphs=cuda and overlap and buckets and config.audio_graphs != "off",
        audio_threads=audio_threads,
        prefill_chunk=PREFILL_BLOCK if PREFILL_CHUNKS[decode] else 0,
    )
