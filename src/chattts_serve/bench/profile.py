"""``chattts-serve profile``: where the time of a request goes, stage by stage, plus a Chrome trace.

Stages: normalise, tokenise, prefill, decode (GPT trunk + heads), sampling, decoder (hidden states ->
mel), vocoder (mel -> audio), encode (audio -> the response format), and "other" (scheduling, stream
bookkeeping: the engine loop's own Python). The model runner times its own stages (prefill, decode,
sampling) through its ``stage_timer``; the others are timed by wrapping the one public function that
does each, on this engine instance only. Every stage carries a ``torch.profiler.record_function`` label
so the trace shows the same names; on CUDA each stage synchronises first, so its time is its own.
Floors: ``decode_floor_ms`` is what one decode step costs at this box's measured memory bandwidth if it
read every weight (the trunk's and the code heads') and every cached key and value it attends to exactly
once and computed nothing (``floor_ratio`` = floor / measured step); ``trunk_floor_ratio`` is the same for
the trunk alone (its weights and the cache against ``trunk_ms_per_step``, where the decode path calls the
trunk once a step: the eager paths); ``rtf_floor`` is that floor as a real-time factor the way
``rtf`` is one (wall per second of audio of all streams together; times ``streams`` for one stream's).
The bandwidth is measured during the timed pass itself (``FloorProbe``): on a shared host it moves by
up to 2x between minutes, so a floor read before or after the pass could not judge the step.
``audio_stage`` times the Decoder + Vocos however they run (``AudioStage``: an ``ov-*`` or graph audio dtype
never calls the eager modules the decoder/vocoder stages wrap), on the engine thread or beside it on the
overlap worker, with the real-time factor of the timed pass's audio over it.
``--trace PATH`` writes the torch.profiler trace (open it in chrome://tracing or
https://ui.perfetto.dev). ``--ops`` (ort-* precisions) runs the same requests once more under ONNX
Runtime's profiler and splits the trunk's decode step by op type (``ort_ops``): the matmuls against the
weights' read floor, attention against the floor of the keys and values it reads, the rest as it is.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import torch

from .. import malloc
from ..engine.config import add_max_num_seqs_argument
from ..engine.decode_path import TrunkDecode
from ..kernels.int4_gemv import Int4GemvWeight
from . import stats
from .common import TEXTS, add_engine_flags, engine_config, fail, peak_memory_mb, set_threads
from .ort_ops import op_breakdown, op_seconds

STAGES = ("normalise", "tokenise", "prefill", "decode", "sampling", "decoder", "vocoder", "encode")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="checkpoint directory or Hugging Face repo id")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None)
    add_engine_flags(p)
    p.add_argument("--text", default=TEXTS[0])
    p.add_argument("--streams", type=int, default=1, help="concurrent requests (the same text, other seeds)")
    p.add_argument("--steps", type=int, default=200, help="audio tokens per request")
    add_max_num_seqs_argument(p, default=None, shown="--streams; 1 = the reference-exact path")
    p.add_argument("--refine", action="store_true", help="include the refine_text pass")
    p.add_argument(
        "--format", default="mp3", help="response format to encode: pcm, wav, mp3, opus, aac, flac, mulaw, alaw"
    )
    p.add_argument("--trace", default=None, help="write a Chrome trace (JSON) here")
    p.add_argument(
        "--ops",
        action="store_true",
        help="ort-* precisions: one more pass under ONNX Runtime's profiler, the trunk step by op type, "
        "matmuls and attention each against its memory floor",
    )


class StageTimer:
    """Adds the wall time of each named stage: as the runner's ``stage_timer`` (``stage(name)``), or
    by wrapping a public function (``wrap``)."""

    def __init__(self, sync) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._sync = sync

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        from torch.profiler import record_function

        self._sync()
        t0 = time.perf_counter()
        with record_function(name):
            yield
            self._sync()
        self.seconds[name] += time.perf_counter() - t0
        self.calls[name] += 1

    def wrap(self, obj: Any, name: str, stage: str) -> None:
        fn = getattr(obj, name)

        @functools.wraps(fn)
        def timed(*a, **k):
            with self.stage(stage):
                return fn(*a, **k)

        setattr(obj, name, timed)


class AudioStage:
    """The Decoder + Vocos stage however it runs (eager, CUDA graphs, OpenVINO or ONNX Runtime graphs; the
    decoder/vocoder stages see only the eager modules, so an ``ov-*`` audio dtype showed none), timed at the
    audio decoder's one call into ``decode_on_device`` (``audio.overlap``), on whichever thread runs it: the
    engine's, or the overlap worker's beside the step. The worker's time ran alongside the engine's stages,
    so it is reported beside the breakdown, not in it. On CUDA a call's time is what its host side took."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)  # "engine" / "worker"
        self.calls = 0
        self.windows = 0
        self._lock = threading.Lock()

    def install(self, module: Any) -> Callable[[], None]:
        """Time ``module.decode_on_device`` from now on; returns what puts it back."""
        real = module.decode_on_device

        @functools.wraps(real)
        def timed(model: Any, windows: list, *a: Any, **k: Any) -> list:
            t0 = time.perf_counter()
            batches = list(real(model, windows, *a, **k))  # a generator: its work happens as it is read
            where = "engine" if threading.current_thread() is threading.main_thread() else "worker"
            with self._lock:
                self.seconds[where] += time.perf_counter() - t0
                self.calls += 1
                self.windows += len(windows)
            return batches

        module.decode_on_device = timed
        return lambda: setattr(module, "decode_on_device", real)

    def snapshot(self, audio_s: float) -> dict[str, Any]:
        with self._lock:
            total = sum(self.seconds.values())
            return {
                "engine_s": round(self.seconds.get("engine", 0.0), 4),
                "worker_s": round(self.seconds.get("worker", 0.0), 4),
                "calls": self.calls,
                "windows": self.windows,
                "x_real_time": round(audio_s / total, 2) if total else None,
            }


def weight_bytes(gpt) -> int:
    """Bytes of GPT projection weights one decode step reads (int8 modes: 1 byte per weight; int4: the
    GEMV's packed stream, codes and scales)."""
    total = 0
    for m in gpt.modules():
        if hasattr(m, "in_features") and hasattr(m, "out_features"):
            w = getattr(m, "weight", None)
            if not isinstance(w, torch.Tensor):  # oneDNN-packed float weights, or fbgemm's int8 ones
                w = getattr(m, "packed", None)
            if isinstance(w, Int4GemvWeight):
                total += w.nbytes
                continue
            per = w.element_size() if isinstance(w, torch.Tensor) else 1
            total += m.in_features * m.out_features * per
    return total


class FloorProbe:
    """Times streaming ``nbytes`` from memory once (a sum over a buffer that size, on torch's threads):
    the time a decode step cannot beat when it reads every weight once and nothing stays in cache.

    ``read`` runs between the timed pass's steps, so the floor is this box's bandwidth in the same
    seconds as the steps it judges. On a CPU the buffer is on huge pages where the kernel allows (as
    the int4 step's weights are: ``malloc.huge_pages``), so no page walks make the floor easier to beat."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        n = max(1, nbytes // 4)
        if device.type == "cpu":
            self.buf = malloc.huge_pages(4 * n).view(torch.float32)
            self.buf.fill_(1.0)  # fault every page in now, not in the first read
        else:
            self.buf = torch.ones(n, dtype=torch.float32, device=device)
        self.device = device
        self.seconds: list[float] = []

    def read(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        self.buf.sum().item()
        dt = time.perf_counter() - t0
        self.seconds.append(dt)
        return dt

    def median_s(self) -> float:
        return statistics.median(self.seconds)


def probe_interval(steps: int) -> int:
    """Engine steps between floor reads: ~16 a pass, never two steps in a row (the step after a read
    finds the caches emptied by it and is left out of the step's time)."""
    return max(2, steps // 16)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from ..audio import overlap as audio_overlap
    from ..audio.encode import FORMATS, encode_whole
    from ..engine.engine import Engine
    from ..kernels.quant import parse_precision
    from ..sampling_params import SamplingParams

    set_threads(args)
    if args.format not in FORMATS:
        raise ValueError(f"--format must be one of {', '.join(FORMATS)}")
    if args.streams < 1 or args.steps < 1:
        raise ValueError("--streams and --steps must be >= 1")
    slots = args.max_num_seqs if args.max_num_seqs is not None else args.streams
    if args.ops and parse_precision(args.precision).onnx is None:  # before the model loads
        raise ValueError("--ops splits the ONNX Runtime step: it needs an ort-* precision (--trace shows torch's ops)")
    config = engine_config(args, max_num_seqs=slots, max_model_len=args.steps + 512)
    engine = Engine.from_pretrained(args.model, device=args.device, config=config)
    core, dev = engine.core, engine.device
    engine.synthesize(["你好。"], SamplingParams(seed=0, max_new_tokens=8, refine_text=False))  # warm-up
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    timer = StageTimer(sync)
    engine.runner.stage_timer = timer  # prefill, decode, sampling
    timer.wrap(core.stage.inputs, "normalizer", "normalise")
    timer.wrap(engine.tokenizer, "encode", "tokenise")
    timer.wrap(engine.model.decoder, "forward", "decoder")
    timer.wrap(engine.model.vocos, "forward", "vocoder")
    response = SimpleNamespace(encode=encode_whole)  # what the server does with the audio
    timer.wrap(response, "encode", "encode")
    audio_stage = AudioStage()
    restore = audio_stage.install(audio_overlap)
    try:
        return _profile(args, engine, timer, audio_stage, response, slots, sync)
    finally:
        restore()


def _profile(
    args: argparse.Namespace,
    engine: Any,
    timer: StageTimer,
    audio_stage: AudioStage,
    response: SimpleNamespace,
    slots: int,
    sync: Callable[[], None],
) -> dict[str, Any]:
    """``run``'s passes on the engine it set up (its audio stage timed until ``run`` puts it back)."""
    import numpy as np
    from torch.profiler import ProfilerActivity, profile

    from ..audio.policy import StreamPolicy
    from ..models.chattts.config import TOKENS_PER_SECOND
    from ..sampling_params import SamplingParams

    core, dev = engine.core, engine.device

    def params(i: int) -> SamplingParams:
        return SamplingParams(seed=1 + i, min_new_tokens=args.steps, max_new_tokens=args.steps, refine_text=args.refine)

    trunk = engine.layout.trunk  # ort-* modes: the weights live in the ONNX export
    # ort-auto: the export a decode step of this many rows reads (the other one's bytes sit idle).
    nbytes = trunk.for_rows(args.streams).weight_bytes if trunk is not None else weight_bytes(engine.model.gpt)
    probe = FloorProbe(nbytes, dev)
    every = probe_interval(args.steps)
    # The timed pass's decode steps: seconds and cached positions read, of steps not right after a read.
    step_s: list[float] = []
    kv_positions: list[int] = []
    # The trunk's share of a step (the eager paths call it once a step; the graph paths replay it whole).
    trunk_s: list[float] = []
    trunk_clock = [0.0]
    path = engine.runner.decode_path
    if isinstance(path, TrunkDecode):
        run_trunk = path.trunk

        def timed_trunk(emb: torch.Tensor, step: Any) -> torch.Tensor:
            sync()
            t0 = time.perf_counter()
            out = run_trunk(emb, step)
            sync()
            trunk_clock[0] += time.perf_counter() - t0
            return out

        path.trunk = timed_trunk  # type: ignore[method-assign]

    def one_pass(timed: bool = False) -> tuple[float, float | None, int, dict[str, list]]:
        audio: dict[str, list] = defaultdict(list)
        steps, first, probed, after_probe = 0, None, 0.0, False
        t0 = time.perf_counter()
        for i in range(args.streams):
            core.add_request(f"profile-{i}", core.prepare(args.text, params(i)), StreamPolicy())
        while core.has_unfinished():
            # Cached positions the step's attention reads: what it must stream besides the weights.
            positions = sum(s.cache_len for s in core.scheduler.running if s.tokens)
            decode_calls, decode_s, trunk_before = timer.calls["decode"], timer.seconds["decode"], trunk_clock[0]
            outs = core.step()
            steps += 1
            if timed and timer.calls["decode"] > decode_calls and not after_probe:
                step_s.append(timer.seconds["decode"] - decode_s)
                kv_positions.append(positions)
                if trunk_clock[0] > trunk_before:
                    trunk_s.append(trunk_clock[0] - trunk_before)
            after_probe = False
            for out in outs:
                if len(out.audio) and first is None:
                    first = time.perf_counter() - t0 - probed
                audio[out.request_id].append(out.audio)
            if timed and steps % every == 0 and core.has_unfinished():
                probed += probe.read()
                after_probe = True
        for chunks in audio.values():
            response.encode(np.concatenate(chunks), args.format, model_rate=engine.sample_rate)
        return time.perf_counter() - t0 - probed, first, steps, audio

    # The timed pass runs without torch.profiler (its per-op bookkeeping would inflate every stage);
    # its numbers are taken now, before --trace adds a second, profiled pass.
    wall, first, steps, audio = one_pass(timed=True)
    audio_s = sum(sum(len(c) for c in chunks) for chunks in audio.values()) / engine.sample_rate
    audio_stage_result = audio_stage.snapshot(audio_s)  # the timed pass's alone
    if not probe.seconds:  # a pass too short to read between its steps
        for _ in range(3):
            probe.read()
    staged = sum(timer.seconds.values())
    breakdown = {
        s: {
            "s": round(timer.seconds.get(s, 0.0), 4),
            "share": round(timer.seconds.get(s, 0.0) / wall, 4),
            "calls": timer.calls.get(s, 0),
        }
        for s in STAGES
    }
    breakdown["other"] = {"s": round(wall - staged, 4), "share": round((wall - staged) / wall, 4), "calls": steps}
    # The step's time and what it reads, over the steps the floor reads left alone (mean, as the floor's
    # KV term is a mean of positions).
    decode_ms = 1000 * sum(step_s) / max(1, len(step_s))
    kv_positions_per_step = sum(kv_positions) / max(1, len(kv_positions))
    top = None
    if args.trace:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with profile(activities=activities) as prof:
            one_pass()
        prof.export_chrome_trace(args.trace)
        top = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
    weight_floor_ms = 1000 * probe.median_s()
    # The decode step's memory floor: its weights plus the keys and values it reads, at the bandwidth
    # just measured; real time for a stream is one step per 21.3 ms (46.875 steps per audio second).
    kv_bytes = kv_positions_per_step * engine.runner.kv_bytes_per_position
    kv_floor_ms = weight_floor_ms * kv_bytes / nbytes
    trunk_floor_ms = weight_floor_ms + kv_floor_ms
    # The step also reads the code heads (bf16 in the int4 mode, fp32 otherwise; models.chattts.embed).
    embed = engine.model.embed
    head_bytes = embed.head_code.numel() * embed.code_heads_dtype.itemsize
    step_floor_ms = trunk_floor_ms + weight_floor_ms * head_bytes / nbytes
    trunk_ms = 1000 * sum(trunk_s) / len(trunk_s) if trunk_s else None
    ort_ops = None
    if args.ops:
        with tempfile.TemporaryDirectory() as tmp:
            trunk.start_op_profile(tmp)
            one_pass()
            recorded = trunk.end_op_profile()
            ort_ops = op_breakdown(op_seconds(recorded.events, recorded.kinds), weight_floor_ms, kv_floor_ms)
    return {
        "bench": "profile",
        "model": str(args.model),
        "device": str(dev),
        "precision": engine.precision.name,
        "kv_cache_dtype": args.kv_cache_dtype,
        "audio_dtype": args.audio_dtype,
        "decode": engine.decode_mode,
        "threads": torch.get_num_threads(),
        "streams": args.streams,
        "max_num_seqs": slots,
        "steps": args.steps,
        "engine_steps": steps,
        "wall_s": round(wall, 3),
        "first_chunk_s": round(first, 3) if first is not None else None,
        "audio_s": round(audio_s, 3),
        "rtf": round(wall / audio_s, 4) if audio_s else None,
        "decode_ms_per_step": round(decode_ms, 2),
        "weight_mb": round(nbytes / 1e6, 1),
        "weight_read_floor_ms": round(weight_floor_ms, 4),
        "floor_reads": len(probe.seconds),
        "floor_read_range_ms": [round(1000 * min(probe.seconds), 4), round(1000 * max(probe.seconds), 4)],
        "decode_steps_timed": len(step_s),
        "kv_read_mb_per_step": round(kv_bytes / 1e6, 1),
        "decode_floor_ms": round(step_floor_ms, 3),
        "floor_ratio": round(step_floor_ms / decode_ms, 3) if decode_ms else None,
        "trunk_ms_per_step": round(trunk_ms, 3) if trunk_ms else None,
        "trunk_ms_p50": round(1000 * statistics.median(trunk_s), 3) if trunk_s else None,
        "trunk_floor_ms": round(trunk_floor_ms, 3),
        "trunk_floor_ratio": round(trunk_floor_ms / trunk_ms, 3) if trunk_ms else None,
        "real_time_step_ms": round(1000 / TOKENS_PER_SECOND, 2),
        "rtf_floor": round(step_floor_ms / (1000 / TOKENS_PER_SECOND) / args.streams, 3),
        "stages": breakdown,
        "audio_stage": audio_stage_result,
        "ort_ops": ort_ops,
        "trace": args.trace,
        "top_ops": top,
        **peak_memory_mb(dev),
    }


def main(args: argparse.Namespace) -> int:
    try:
        result = run(args)
    except ValueError as exc:
        return fail(str(exc))
    table = result.pop("top_ops")
    stats.emit(result)
    if table:
        import sys

        print(table, file=sys.stderr)  # the op table for humans; stdout stays one JSON line
    return 0
