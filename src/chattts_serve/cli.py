"""The ``chattts-serve`` command.

chattts-serve synthesize "Hello." -o hello.wav [--model DIR|REPO] [--family NAME] [--seed N] [--speaker STR]
chattts-serve synthesize --input texts.txt --output-dir out/ [--max-num-seqs N] [--devices cuda:0,cuda:1]
chattts-serve ray serve --model DIR --num-replicas N      chattts-serve ray batch --input F --output-dir D
chattts-serve speaker new [--model DIR|REPO] [--seed N]
chattts-serve checkpoint random DIR [--family chattts|...] [--size tiny|full] [--seed N]
chattts-serve export onnx --out DIR [--model DIR|REPO] [--quant fp32|int8|int4|int4-b128] [--provider cpu|cuda|tensorrt]
chattts-serve bench offline|streams|serve|family|host-overhead ...   chattts-serve profile ...   chattts-serve eval ...
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

from . import models
from .engine.config import add_engine_arguments, add_max_num_seqs_argument
from .kernels.onnx_runtime import WEIGHT_KINDS
from .models.chattts.config import DEFAULT_MODEL
from .models.family import SIZES
from .models.flags import add_family_arguments, with_family_options
from .sampling_params import SAMPLING_FLAGS, SamplingParams, add_sampling_arguments

MODEL_ENV = "CHATTTS_SERVE_MODEL"


def _model_default() -> str:
    return os.environ.get(MODEL_ENV, DEFAULT_MODEL)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=_model_default(),
        help=f"checkpoint directory or Hugging Face repo id (default: ${MODEL_ENV} or {DEFAULT_MODEL})",
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    # max_num_seqs: each command adds its own (``add_max_num_seqs_argument``: "auto", the old --batch-size).
    add_engine_arguments(p, skip=("max_num_seqs", "max_waiting"))


def _build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="chattts-serve", description="Fast, faithful ChatTTS inference.")
    ap.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = ap.add_subparsers(dest="command", required=True)

    syn = sub.add_parser("synthesize", help="text to WAV files")
    syn.add_argument("text", nargs="?", help="text to speak (or use --input)")
    syn.add_argument("-o", "--output", default="out.wav", help="output WAV for a single text")
    syn.add_argument(
        "--input",
        help="texts: a UTF-8 file, one per line (or .jsonl / .parquet: text, id, seed, voice, options); one WAV each",
    )
    syn.add_argument("--output-dir", default="out", help="where --input writes its WAVs (0001.wav, ... or <id>.wav)")
    syn.add_argument(
        "--devices",
        type=lambda v: [d.strip() for d in v.split(",") if d.strip()],
        help="with --input: one process per device over an equal share of the texts (e.g. cuda:0,cuda:1)",
    )
    add_max_num_seqs_argument(syn, default=16, auto=True)
    _add_model_args(syn)
    syn.add_argument("--family", choices=models.names(), help="the model family (default: detected from --model)")
    add_sampling_arguments(syn)
    add_family_arguments(syn)
    syn.set_defaults(func=_synthesize)

    from .server.config import WYOMING_URI, add_server_arguments

    srv = sub.add_parser("serve", help="run the HTTP/WebSocket server (OpenAI-compatible + native API)")
    add_server_arguments(srv)
    srv.set_defaults(func=_serve)

    wy = sub.add_parser("wyoming", help="run only the Wyoming protocol server (Home Assistant), no HTTP API")
    add_server_arguments(wy)
    wy.add_argument("--uri", dest="wyoming_uri", help=f"where to listen (default: {WYOMING_URI}); = --wyoming-uri")
    wy.set_defaults(func=_wyoming)

    from .distributed.cli import add_arguments as add_ray_arguments  # no ray import until a ray command runs

    add_ray_arguments(
        sub.add_parser("ray", help="scale out on Ray: Serve replicas, Data batch jobs (needs the .[ray] extra)"),
        server_args=add_server_arguments,
        model_args=_add_model_args,
        sampling_args=_add_all_sampling_arguments,
        sampling_flags=SAMPLING_FLAGS,
    )

    spk = sub.add_parser("speaker", help="speaker strings")
    spk_sub = spk.add_subparsers(dest="speaker_command", required=True)
    new = spk_sub.add_parser("new", help="print a random speaker string")
    new.add_argument("--model", default=_model_default())
    new.add_argument("--seed", type=int, default=None)
    new.set_defaults(func=_speaker_new)

    bench = sub.add_parser("bench", help="benchmarks: offline throughput, in-process streams, HTTP load")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    for name, help_ in (
        ("offline", "N texts through the offline engine: throughput, latency, memory (vs the reference)"),
        ("streams", "concurrent streams in one process: first chunk, RTF, underruns (vs the reference)"),
        ("serve", "drive a running server over HTTP: concurrency sweep or Poisson arrivals"),
        ("attention", "decode attention over the KV cache against the memory read floor (full-size shapes)"),
        ("kernels", "the trunk's weight matmuls per library and kernel against the weight-read floor"),
        ("audio", "the audio stage (Decoder + Vocos) per window in torch, ONNX Runtime and OpenVINO"),
        ("family", "any family against its own package: one request, 8 concurrent, first audio (interleaved)"),
    ):
        _bench_command(bench_sub.add_parser(name, help=help_), name)
    overhead = bench_sub.add_parser("host-overhead", help="host time of a decode step per sequence at 64 / 256 / 512")
    _bench_command(overhead, "host_overhead")
    _bench_command(sub.add_parser("profile", help="per-stage time of a request and a Chrome trace"), "profile")
    _bench_command(sub.add_parser("eval", help="quality cost of each precision vs fp32"), "eval")

    ck = sub.add_parser("checkpoint", help="checkpoint tools")
    ck_sub = ck.add_subparsers(dest="checkpoint_command", required=True)
    rnd = ck_sub.add_parser("random", help="write a random-weight checkpoint in a family's official layout")
    rnd.add_argument("directory")
    rnd.add_argument("--family", choices=models.names(), default="chattts", help="the model family (default: chattts)")
    rnd.add_argument("--size", choices=SIZES, default="tiny", help="tiny (tests) or full (the official dimensions)")
    rnd.add_argument("--seed", type=int, default=0)
    rnd.set_defaults(func=_checkpoint_random)

    exp = sub.add_parser("export", help="export the model for other runtimes")
    exp_sub = exp.add_subparsers(dest="export_command", required=True)
    onnx = exp_sub.add_parser(
        "onnx", help="the GPT trunk step as an ONNX graph for ONNX Runtime (what the ort-* precisions run)"
    )
    onnx.add_argument("--model", default=_model_default(), help="checkpoint directory or Hugging Face repo id")
    onnx.add_argument("--out", required=True, help="directory for model.onnx, model.onnx.data and manifest.json")
    onnx.add_argument(
        "--quant",
        choices=WEIGHT_KINDS,
        default="fp32",
        help="weights: fp32, int8 (per channel, activations quantised per call) or int4 / int4-b128 (MatMulNBits, "
        "block 32 / 128)",
    )
    onnx.add_argument(
        "--provider",
        choices=("cpu", "cuda", "tensorrt"),
        default="cpu",
        help="ONNX Runtime execution provider to load the export on and run one step with, as a check "
        "(cuda/tensorrt: refused unless onnxruntime-gpu, a CUDA device, and GroupQueryAttention really "
        "running on that provider; use --device cuda with bf16/fp16 instead)",
    )
    onnx.add_argument(
        "--reduce-range",
        choices=("auto", "on", "off"),
        default="auto",
        help="int8: 7-bit weights, for x86 CPUs without VNNI whose u8 x s8 kernel can saturate (auto: probe "
        "this CPU, as the engine does)",
    )
    onnx.set_defaults(func=_export_onnx)
    return ap


_MODULES = {"audio": "audio_stage"}
"""Commands whose module has another name (``bench/audio.py`` would read as the ``audio`` package)."""


def _bench_command(p: argparse.ArgumentParser, name: str) -> None:
    """A command whose flags and ``main`` live in ``bench/<name>.py``."""
    import importlib

    module = importlib.import_module(f".bench.{_MODULES.get(name, name)}", __package__)
    module.add_arguments(p)
    p.set_defaults(func=module.main)


def _serve(args: argparse.Namespace) -> int:
    from .server.config import ServerConfig
    from .server.run import run_server

    return run_server(ServerConfig.from_args(args))


def _wyoming(args: argparse.Namespace) -> int:
    from .server.config import ServerConfig
    from .server.run import run_wyoming

    return run_wyoming(ServerConfig.from_args(args))


def _add_all_sampling_arguments(p: argparse.ArgumentParser) -> None:
    """ChatTTS's sampling flags and every family's own (``models.flags``: ``--noise-scale``, ``--lang-code``)."""
    add_sampling_arguments(p)
    add_family_arguments(p)


def _synthesize(args: argparse.Namespace) -> int:
    from .audio.wav import write_wav
    from .distributed.jobs import Item, item_params, read_items, with_seed
    from .engine.config import EngineConfig, engine_config_from_args
    from .engine.engine import Engine

    if (args.text is None) == (args.input is None):
        raise ValueError("give either a text or --input FILE")
    if args.devices and not args.input:
        raise ValueError("--devices needs --input")
    params = SamplingParams.from_options(**{name: getattr(args, name) for name in SAMPLING_FLAGS})
    params = with_family_options(params, args)
    if args.input:
        items = with_seed(read_items(args.input), params.seed)  # the same ids and seeds as `ray batch`
    else:
        if not args.text.strip():
            raise ValueError("the text is empty")
        items = [Item("out", args.text, params.seed)]
    # max_num_seqs None ("auto"): sized from free memory when the engine loads.
    config = engine_config_from_args(args, EngineConfig(auto_slots=args.max_num_seqs is None))
    out_dir = Path(args.output_dir)
    if args.input:
        out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    if args.devices:
        from .distributed.offline import run_on_devices

        entries = run_on_devices(args.devices, args.model, config, params, items, out_dir, family=args.family)
        wall = time.perf_counter() - start
        failed = [e for e in entries if e.error]
        if failed:
            raise ValueError(f"text {failed[0].id}: {failed[0].error}")
        paths, audio_s = [out_dir / e.file for e in entries], sum(e.duration for e in entries)
    else:
        engine = Engine.from_pretrained(args.model, device=args.device, config=config, family=args.family)
        start = time.perf_counter()
        texts = [it.text for it in items]
        results = engine.synthesize(texts, [item_params(params, it) for it in items], progress=True)
        wall = time.perf_counter() - start
        paths = [out_dir / it.file_name for it in items] if args.input else [Path(args.output)]
        for path, r in zip(paths, results, strict=True):
            write_wav(path, r.audio, r.sample_rate)
        audio_s = sum(r.duration for r in results)
    print(
        f"wrote {len(paths)} file(s), {audio_s:.2f} s of audio in {wall:.2f} s (RTF {wall / max(audio_s, 1e-9):.2f})"
        + (f": {paths[0]}" if len(paths) == 1 else f" to {paths[0].parent}/")
    )
    return 0


def _speaker_new(args: argparse.Namespace) -> int:
    import torch

    from .models.chattts import checkpoint
    from .models.chattts.speaker import default_speaker_stats, encode_speaker

    # The official statistics ship with the package, so the default model needs no download; a local
    # checkpoint may carry its own (random test checkpoints of other sizes do).
    path = Path(args.model).expanduser()
    stats = default_speaker_stats()
    if path.exists() or args.model.startswith((".", "/", "~")):
        stats = checkpoint.read_speaker_stats(checkpoint.resolve(path))
    gen = torch.Generator().manual_seed(args.seed) if args.seed is not None else None
    print(encode_speaker(stats.sample(gen)))
    return 0


def _checkpoint_random(args: argparse.Namespace) -> int:
    root = models.get(args.family).write_random(args.directory, args.size, seed=args.seed)
    family = "" if args.family == "chattts" else f"{args.family} "
    print(f"wrote a random {args.size} {family}checkpoint (seed {args.seed}) to {root}")
    return 0


def _export_onnx(args: argparse.Namespace) -> int:
    from .models.chattts import checkpoint
    from .models.chattts.onnx_export import export
    from .models.chattts.onnx_trunk import check_export

    model = checkpoint.load(args.model)
    reduce_range = {"auto": None, "on": True, "off": False}[args.reduce_range]
    out = export(model, args.out, args.quant, reduce_range=reduce_range)
    check_export(out, model.config.gpt, args.quant, args.provider)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"wrote the GPT trunk ({args.quant}, {size / 1e6:.1f} MB) to {out}; checked on ORT's {args.provider}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from .models.chattts.checkpoint import CheckpointError

    try:
        return args.func(args)
    except (ValueError, CheckpointError) as exc:
        print(f"chattts-serve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
