"""The engine's configuration tree: one ``EngineConfig`` that ``Engine``, ``AsyncEngine``, the CLI and
``ServerConfig`` all hold, so a limit has one name, one default and one check.

    EngineConfig
    ├── precision     str               fp32 | bf16 | fp16 | int8 | int8-dynamic | int8-static | int4 | ort-*
                                        (ort-fp32 | ort-int8 | ort-int4 | ort-int4-b128 | ort-auto)
    ├── scheduler     SchedulerConfig   KV slots, slot length, queue bound, prefill budget
    ├── runner        RunnerConfig      decode step: rows | static, CUDA graphs, torch.compile, KV dtype, ONNX cache
    └── stream        StreamPolicy      default chunking of streamed audio (per request overridable)

No torch here (the CLI builds its argument parser from these defaults before torch is imported).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field, fields, replace
from typing import Any

from ..audio.policy import StreamPolicy
from ..kernels.precisions import PRECISIONS
from .scheduler import SchedulerConfig

DECODE_MODES = ("auto", "rows", "static")
KV_CACHE_DTYPES = ("auto", "bf16", "int8")
AUDIO_GRAPH_DTYPES = ("ort-fp32", "ov-fp32", "ov-bf16", "ov-int8")
"""The Decoder + Vocos as one ONNX Runtime / OpenVINO graph (CPU only; ``audio.cpu_graph.RUNTIMES``)."""
AUDIO_DTYPES = ("auto", "fp32", "tf32", "bf16", *AUDIO_GRAPH_DTYPES)
SWITCHES = ("auto", "on", "off")
SAMPLING_NOISES = ("auto", "generator", "counter")  # engine.noise


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    """How the model runner executes a decode step."""

    decode: str = "auto"
    """"rows": per-row attention over each sequence's exact keys (batch-invariant; CPU default);
    "static": ``GPT.decode_static`` (graph-capturable; CUDA default); "auto" picks by device."""
    cuda_graphs: bool = True
    """Capture the static step in CUDA graphs (CUDA only; ignored elsewhere); for a batch family (Kokoro, VITS),
    its decoder per (rows, length) bucket (``engine.bucket_graphs``)."""
    strict_cuda_graphs: bool = False
    """A captured graph that differs from the eager step at its start-up self-check raises (default:
    that graph is dropped with one warning and its shape runs eagerly; see ``engine.cuda_graph``)."""
    compile: bool = False
    """``torch.compile`` the static step (inductor; fuses the elementwise ops between matmuls)."""
    onnx_cache_dir: str | None = None
    """Where the ``ort-*`` precisions keep their ONNX exports of the trunk, one per checkpoint and
    mode (None: ``onnx`` in the user cache directory), and ChatTTS's ``ov-*`` audio dtypes their OpenVINO
    graphs (``audio.graph_cache``; None: ``openvino`` in the user cache directory)."""
    ort_auto_crossover: int = 0
    """``ort-auto``: trunk calls of this many rows or more run the int8 export, narrower ones the
    4-bit one (0: from the table for this CPU, ``models.chattts.onnx_auto.CROSSOVER_TABLE``)."""
    kv_cache_dtype: str = "auto"
    """"auto": the trunk's dtype; "bf16": half the cache bytes under an fp32 or int8 trunk (attention
    then runs in bf16; batched decode steps are cache-bound). Torch modes only."""
    sampling_noise: str = "auto"
    """The sampler's random draws (``engine.noise``): "generator" (one torch.Generator per sequence,
    reference-identical; the CPU default), "counter" (a hash of seed, step, row and column for the
    whole batch in one call, batch-invariant but not the reference's stream; the CUDA default), or
    "auto" (by device)."""
    step_graphs: str = "auto"
    """A step's decode rows (code and text) as one graph: embed, trunk, heads and sampling
    (``engine.step_graph``). "auto": where CUDA graphs are captured with counter noise (the CUDA
    defaults); "on": also eagerly without CUDA (the same function; tests); "off": the trunk alone."""

    def __post_init__(self) -> None:
        if self.decode not in DECODE_MODES:
            raise ValueError(f"decode must be one of {', '.join(DECODE_MODES)}; got {self.decode!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {self.kv_cache_dtype!r}")
        if self.sampling_noise not in SAMPLING_NOISES:
            raise ValueError(f"sampling_noise must be one of {', '.join(SAMPLING_NOISES)}; got {self.sampling_noise!r}")
        if self.step_graphs not in SWITCHES:
            raise ValueError(f"step_graphs must be one of {', '.join(SWITCHES)}; got {self.step_graphs!r}")
        if self.ort_auto_crossover < 0:
            raise ValueError(f"ort_auto_crossover must be >= 0 (0: from the CPU table), got {self.ort_auto_crossover}")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    precision: str = "fp32"
    """GPT precision (see ``kernels.quant``); every mode loads the official fp32 files."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    """``max_waiting`` below ``max_num_seqs`` is raised to it."""
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    stream: StreamPolicy = field(default_factory=StreamPolicy)
    """Chunking of streamed audio when a request does not choose its own."""
    auto_slots: bool = False
    """Size the KV slots (``scheduler.max_num_seqs``) from free memory at load time instead."""
    max_audio_seconds: float = 600.0
    """Audio one request may generate in all (its sentences, and the first-sentence voice step): a
    request whose ``min_new_tokens`` alone would pass it is refused; otherwise each sentence's
    ``max_new_tokens`` is capped at its share, so no request can hold the engine for longer."""
    audio_dtype: str = "auto"
    """Decoder + Vocos: "fp32" (reference-exact waveform; strict IEEE fp32 on CUDA too, convolutions
    included), "tf32" (TF32 matmuls and convolutions on CUDA, scoped to the decode; fp32 elsewhere)
    or "bf16" (autocast; 1.6-2.4x faster where the CPU has AVX-512 BF16 or AMX, ~36 dB SNR against
    fp32; slower elsewhere, see ``cpu.CpuInfo.bf16``). "auto": bf16 on CUDA, fp32 elsewhere."""
    audio_overlap: str = "auto"
    """"on": the audio decode runs beside the next GPT step, its audio taken at a later step (``audio.overlap``):
    on CUDA on a stream of its own, on a CPU on a worker thread (the other core); "off": inside the step.
    "auto": on for CUDA, and on a CPU with 2 or more torch threads (``engine.plan``)."""
    audio_graphs: str = "auto"
    """"on": Decoder + Vocos as CUDA graphs per window bucket, captured at start-up on the audio stream
    (``audio.graphs``; needs the overlapped, bucketed decode on CUDA). "auto": on where those are."""
    host_ahead: str = "auto"
    """"on": the host schedules and queues step n+1 before it reads step n's tokens (they live on the
    device; the host needs them only for stops and audio), so its work overlaps the device's; a sequence
    that ended runs one discarded step (``EngineCore``). "off": one step at a time. "auto": on for CUDA."""
    audio_buckets: str = "auto"
    """"on": windows padded to a few fixed lengths (``audio.decode.window_bucket``; the padding masked,
    so only float rounding changes), so the kernels see repeating shapes. "auto": on for CUDA."""

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}; got {self.precision!r}")
        if self.audio_dtype not in AUDIO_DTYPES:
            raise ValueError(f"audio_dtype must be one of {', '.join(AUDIO_DTYPES)}; got {self.audio_dtype!r}")
        for name in ("audio_overlap", "audio_buckets", "audio_graphs", "host_ahead"):
            if getattr(self, name) not in SWITCHES:
                raise ValueError(f"{name} must be one of {', '.join(SWITCHES)}; got {getattr(self, name)!r}")
        if not self.max_audio_seconds > 0:
            raise ValueError(f"max_audio_seconds must be > 0, got {self.max_audio_seconds!r}")
        sc = self.scheduler
        if sc.max_waiting < sc.max_num_seqs:
            # A burst as large as the slots must queue (it is admitted next step), not be refused with
            # slots free: the waiting bound is at least the slot count (auto slots included).
            object.__setattr__(self, "scheduler", replace(sc, max_waiting=sc.max_num_seqs))

    @classmethod
    def with_slots(cls, max_num_seqs: int, **kw) -> EngineConfig:
        """Shorthand: ``max_num_seqs`` KV slots, every other scheduling limit at its default."""
        return cls(scheduler=SchedulerConfig(max_num_seqs=max_num_seqs), **kw)


# --------------------------------------------------------------------------------------------------
# Flat options: the names the CLI flags, ServerConfig and CHATTTS_SERVE_* variables use for the tree.

FLAT_OPTIONS: dict[str, tuple[str, ...]] = {
    "precision": ("precision",),
    "max_num_seqs": ("scheduler", "max_num_seqs"),
    "max_model_len": ("scheduler", "max_model_len"),
    "max_waiting": ("scheduler", "max_waiting"),
    "max_prefill_tokens": ("scheduler", "max_prefill_tokens"),
    "max_batch_work": ("scheduler", "max_batch_work"),
    "decode": ("runner", "decode"),
    "cuda_graphs": ("runner", "cuda_graphs"),
    "compile": ("runner", "compile"),
    "onnx_cache_dir": ("runner", "onnx_cache_dir"),
    "ort_auto_crossover": ("runner", "ort_auto_crossover"),
    "kv_cache_dtype": ("runner", "kv_cache_dtype"),
    "sampling_noise": ("runner", "sampling_noise"),
    "step_graphs": ("runner", "step_graphs"),
    "max_audio_seconds": ("max_audio_seconds",),
    "audio_dtype": ("audio_dtype",),
    "audio_overlap": ("audio_overlap",),
    "audio_buckets": ("audio_buckets",),
    "audio_graphs": ("audio_graphs",),
    "host_ahead": ("host_ahead",),
}
_HELP = {
    "precision": "GPT precision: fp32 (reference-exact), bf16, fp16 (CUDA), int8 (weights), int8-dynamic and "
    "int8-static (CPU, int8 activations too), int4 (CPU, 4-bit weights on the AVX-512 VNNI GEMV), ort-fp32 / "
    "ort-int8 / ort-int4 / ort-int4-b128 (the trunk in ONNX Runtime, CPU; needs the [onnx] extra), ort-auto "
    "(ort-int4 while few rows decode, ort-int8 from "
    "--ort-auto-crossover on); see the README's quality table",
    "max_num_seqs": "KV-cache slots: sequences decoding at once",
    "max_model_len": "positions per slot (prompt + max_new_tokens of any sequence; at most the checkpoint's "
    "max_position_embeddings; fixed slots are shortened at load where memory does not hold them)",
    "max_waiting": "sequences that may wait for a slot; beyond it submissions are refused",
    "max_prefill_tokens": "prompt tokens prefilled per step while streams decode (a longer prompt goes in chunks "
    "over several steps): bounds how long one step stalls the running streams",
    "max_batch_work": "batch families (whole utterances, no KV slots): input tokens one step's batch may hold "
    "(--max-num-seqs caps its rows)",
    "decode": "decode step: rows (batch-invariant; CPU default) or static (fixed shapes, CUDA graphs; CUDA default)",
    "cuda_graphs": "capture the static decode step in CUDA graphs (CUDA only); Kokoro's and VITS's decoders per "
    "length bucket",
    "compile": "torch.compile the static decode step (ChatTTS), the decoder's AdaIN + snake (Kokoro)",
    "onnx_cache_dir": "where the ort-* precisions cache their ONNX exports and the ov-* audio dtypes their "
    "OpenVINO graphs (default: the user cache directory)",
    "ort_auto_crossover": "ort-auto: trunk calls of this many rows or more run int8, narrower ones 4-bit "
    "(0: from a table by CPU)",
    "kv_cache_dtype": "KV cache dtype: auto (the trunk's; int4: int8 on AVX-512 CPUs), bf16 (half the bytes; "
    "attention in bf16) or int8 (int8 vectors with an fp32 scale each, 0.27 of fp32's bytes; attention in fp32; "
    "CPU); torch precisions",
    "sampling_noise": "sampling noise: generator (one torch.Generator per sequence, reference-identical; CPU "
    "default), counter (hash of seed and step, one batched draw, batch-invariant; CUDA default) or auto",
    "step_graphs": "a step's decode rows as one CUDA graph: embed, trunk, heads and sampling (auto: with CUDA "
    "graphs and counter noise; on: also eagerly on a CPU)",
    "max_audio_seconds": "audio one request may generate in all (its sentences x max_new_tokens are capped to fit)",
    "audio_dtype": "the audio stage's dtype (ChatTTS: Decoder + Vocos; Kokoro: its iSTFTNet decoder): fp32 "
    "(reference-exact, no TF32), tf32 (CUDA) or bf16 (faster on CPUs with AVX-512 BF16 / AMX); CPU only, as one "
    "graph: ort-fp32 (ONNX Runtime, ChatTTS), ov-fp32 / ov-bf16 (OpenVINO), faster than torch's at the same "
    "dtype, not bit-exact; ov-int8 (ChatTTS: its pointwise linears in int8 by SmoothQuant, calibrated at "
    "start-up on the trunk's own hidden states, the rest bf16; ~1.6x ov-bf16 at 34 dB); auto: bf16 on CUDA, "
    "fp32 elsewhere",
    "audio_overlap": "audio decode beside the next GPT step: its own CUDA stream, or a CPU worker thread "
    "(auto: on for CUDA, and on a CPU with 2 or more --threads)",
    "audio_buckets": "pad audio windows to a few fixed lengths so shapes repeat (auto: on for CUDA)",
    "audio_graphs": "Decoder + Vocos as CUDA graphs per window bucket, captured at start-up on the audio stream "
    "(auto: on for CUDA with the overlapped, bucketed decode)",
    "host_ahead": "queue step n+1 before reading step n's tokens, the host's work overlapping the device's "
    "(auto: on for CUDA, and on a CPU with 2 or more --threads)",
}


def flat_defaults(config: EngineConfig | None = None) -> dict[str, Any]:
    """Each flat option's value in ``config`` (default: ``EngineConfig()``)."""
    config = config or EngineConfig()
    out = {}
    for name, path in FLAT_OPTIONS.items():
        value: Any = config
        for part in path:
            value = getattr(value, part)
        out[name] = value
    return out


def from_flat(base: EngineConfig | None = None, **options: Any) -> EngineConfig:
    """``base`` (default: ``EngineConfig()``) with the given flat options set; None values are skipped."""
    config = base or EngineConfig()
    unknown = set(options) - set(FLAT_OPTIONS)
    if unknown:
        raise ValueError(f"unknown engine option(s): {', '.join(sorted(unknown))}")
    top: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    for name, value in options.items():
        if value is None:
            continue
        path = FLAT_OPTIONS[name]
        if len(path) == 1:
            top[path[0]] = value
        else:
            nested.setdefault(path[0], {})[path[1]] = value
    for part, changes in nested.items():
        top[part] = replace(getattr(config, part), **changes)
    return replace(config, **top)


def add_engine_arguments(
    p: argparse.ArgumentParser, *, none_defaults: bool = False, skip: tuple[str, ...] = ()
) -> None:
    """One ``--flag`` per flat option, with the dataclass default (``none_defaults``: None, for callers
    that layer environment variables underneath)."""
    for name, default in flat_defaults().items():
        if name in skip:
            continue
        flag = "--" + name.replace("_", "-")
        shown = "" if default is None else f"(default: {default!r})"
        kw: dict[str, Any] = {"dest": name, "default": None if none_defaults else default}
        if isinstance(default, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, help=f"{_HELP[name]} {shown}", **kw)
        else:
            choices = {
                "precision": PRECISIONS,
                "decode": DECODE_MODES,
                "kv_cache_dtype": KV_CACHE_DTYPES,
                "sampling_noise": SAMPLING_NOISES,
                "step_graphs": SWITCHES,
                "audio_dtype": AUDIO_DTYPES,
                "audio_overlap": SWITCHES,
                "audio_buckets": SWITCHES,
                "audio_graphs": SWITCHES,
                "host_ahead": SWITCHES,
            }.get(name)
            kind = str if default is None else type(default)
            p.add_argument(flag, type=kind, choices=choices, help=f"{_HELP[name]} {shown}".strip(), **kw)


def add_max_num_seqs_argument(
    p: argparse.ArgumentParser, *, default: int | None, auto: bool = False, note: str = "", shown: str = ""
) -> None:
    """``--max-num-seqs`` where a command sizes the KV slots itself rather than through
    ``add_engine_arguments``: ``synthesize`` (``auto``: "auto" parses to None, sized from free memory),
    ``ray batch`` and the bench tools (None: sized from their other flags, as ``shown`` says).
    ``--batch-size``, the old spelling of these commands, still works and warns."""
    kind = _slots_or_auto if auto else _slots
    shown = shown or ("'auto'" if auto and default is None else repr(default))
    also = "; N or auto (sized from free memory at load)" if auto else ""
    help_ = f"{_HELP['max_num_seqs']}{note}{also} (default: {shown})"
    p.add_argument("--max-num-seqs", dest="max_num_seqs", type=kind, default=default, help=help_)
    p.add_argument(
        "--batch-size",
        dest="max_num_seqs",
        type=kind,
        action=DeprecatedFlag,
        canonical="--max-num-seqs",
        default=argparse.SUPPRESS,
        help=argparse.SUPPRESS,
    )


class DeprecatedFlag(argparse.Action):
    """An old spelling of a flag: stores what the new one stores and says once that it is deprecated."""

    def __init__(self, option_strings: list[str], dest: str, canonical: str, **kw: Any) -> None:
        super().__init__(option_strings, dest, **kw)
        self.canonical = canonical

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(f"{parser.prog}: warning: {option_string} is deprecated; use {self.canonical}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def _slots(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {value!r}")
    return n


def _slots_or_auto(value: str) -> int | None:
    if value == "auto":
        return None
    try:
        return _slots(value)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a positive int or 'auto', got {value!r}") from None


def engine_config_from_args(args: argparse.Namespace, base: EngineConfig | None = None) -> EngineConfig:
    return from_flat(base, **{name: getattr(args, name) for name in FLAT_OPTIONS if hasattr(args, name)})


assert set(FLAT_OPTIONS) == set(_HELP)
assert {p[0] for p in FLAT_OPTIONS.values()} <= {f.name for f in fields(EngineConfig)}
