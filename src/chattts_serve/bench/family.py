"""``chattts-serve bench family``: any family's model against its own package, interleaved in one run.

Three figures, each the median of ``--rounds`` (3) rounds, ours and the package's rounds interleaved so load on a
shared machine falls on both alike:

- **single**: one request (``--lang``'s first text, about 100 phonemes) alone, start to last sample; ours vs the
  package.
- **concurrent**: ``--requests`` (8) requests of mixed lengths sent at once through our engine (``AsyncEngine``,
  the server's engine without HTTP) vs the package running them one at a time, as its users' servers do: aggregate
  audio seconds per wall second.
- **first audio**: a 5-sentence text streamed through our engine, time to its first audio (then cancelled),
  against the time of its first sentence alone (the single request): streaming by sentence means about the same.

The result (one JSON line) records the CPU (``cpu.probe``), torch's threads and the load average before and after:
compare figures from one run only.

The bench knows a family only through the registry (``models.detect``) and the engine; the package's side is a
standalone script beside the family's code, ``models/<family>/reference_bench.py``, run under
``--reference-python`` (the reference environment). Its protocol, which every family's script keeps::

    REFPY reference_bench.py CKPT JOBS.json      # prints one JSON line on stdout (its last line)

``CKPT`` is the checkpoint directory (resolved), ``JOBS.json`` is
``{"threads": N, "rounds": R, "requests": [REQUEST, ...]}`` and a ``REQUEST`` is
``{"text": str, "voice": str | null, "lang": "zh" | "en" | null, "seed": int}`` (``voice`` null: the package's
default voice; the script maps these to its package's own call, e.g. a ``KPipeline`` language and voice file). The
script imports nothing from chattts_serve, sets torch's threads to N, runs every request once untimed or a short
warm-up of its choosing, then R times: ``requests[0]`` alone (``single_s``), then ``requests[1:]`` one after another
(``sequential_s``), and prints::

    {"package": "kokoro 0.9.4", "single_s": [R floats], "sequential_s": [R floats], "audio_s": [one per request]}

(``audio_s``: each request's audio seconds; extra keys are kept in the result). The bench calls it with R = 1
once per round.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from .common import add_engine_flags, engine_config, run_tool

# Mixed lengths (about 20 to 100 phonemes each in Chinese); the first is the "single" request, the first five
# joined make the 5-sentence text.
SENTENCES: dict[str, tuple[str, ...]] = {
    "zh": (
        "四川美食确实以辣闻名，但也有不辣的选择，比如甜水面、赖汤圆和蛋烘糕。",
        "今天天气真不错，我们一起去公园散步吧。",
        "流式语音合成在整句话完成之前就先送出第一段声音。",
        "你好，欢迎使用。",
        "这家小店的面条很有名，每天早上门口都排着长队，老板说秘诀在于汤底要熬一整夜。",
        "请在会议开始前十分钟到达。",
        "火车晚点了半个小时，不过我们还是赶上了晚饭。",
        "谢谢大家。",
        "图书馆周末也开放，学生们可以在那里安静地复习功课。",
    ),
    "en": (
        "The quick brown fox jumps over the lazy dog, then naps for a while in the warm afternoon sun.",
        "It is a fine day for a walk in the park.",
        "Streaming speech sends the first audio before the whole sentence is done.",
        "Hello, and welcome.",
        "The small noodle shop down the road is famous, and every morning a long line waits outside its door.",
        "Please arrive ten minutes early.",
        "The train was half an hour late, but we still made it home for dinner.",
        "Thank you all.",
        "The library is open at weekends, so students can revise there in peace.",
    ),
}
SEED = 1000


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="checkpoint directory or Hugging Face repo id")
    p.add_argument("--family", default=None, help="the model family (default: detected from the checkpoint)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads, ours and the package's "
                   "(default: torch's choice)")
    add_engine_flags(p)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; figures are their medians")
    p.add_argument("--requests", type=int, default=8, help="concurrent mixed-length requests (at most "
                   f"{len(SENTENCES['zh']) - 1})")
    p.add_argument("--lang", choices=sorted(SENTENCES), default="zh", help="the texts' language (Kokoro's package "
                   "phonemizes English only with spaCy's model: offline, zh)")
    p.add_argument("--voice", default=None, help="a built-in voice name (default: the family's default voice)")
    p.add_argument("--reference-python", default=None, help="python of the reference environment: also time the "
                   "family's package (models/<family>/reference_bench.py) in the same run, and print ratios")
    p.set_defaults(plot=None)  # run_tool's: this bench draws none


def requests(lang: str, n: int, voice: str | None) -> tuple[list[dict[str, Any]], str]:
    """The protocol's request list (the single request, then ``n`` mixed ones) and the 5-sentence text."""
    pool = SENTENCES[lang]
    if not 1 <= n < len(pool):
        raise ValueError(f"--requests must be in 1..{len(pool) - 1}")
    texts = [pool[0], *pool[1 : n + 1]]
    joiner = "" if lang == "zh" else " "
    return ([{"text": t, "voice": voice, "lang": lang, "seed": SEED + i} for i, t in enumerate(texts)],
            joiner.join(pool[:5]))


def reference_script(family) -> Path:
    """``reference_bench.py`` beside the family's module; ValueError when the family has none."""
    path = Path(importlib.import_module(type(family).__module__).__file__).with_name("reference_bench.py")
    if not path.is_file():
        raise ValueError(f"the {family.name} family has no reference benchmark ({path.name} beside its family.py)")
    return path


def run_reference(python: str, script: Path, ckpt: Path, jobs: dict[str, Any], timeout: float = 3600) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "jobs.json"
        path.write_text(json.dumps(jobs, ensure_ascii=False), encoding="utf-8")
        # -I: the script's folder must not go first on sys.path (a sibling module could shadow the stdlib's).
        res = subprocess.run([python, "-I", str(script), str(ckpt), str(path)], capture_output=True, text=True,
                             timeout=timeout)
    if res.returncode != 0:
        raise RuntimeError(f"reference run failed ({res.returncode}): {res.stderr.strip()[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


async def _one(engine, request: dict[str, Any], voice: str | None, first_only: bool = False
               ) -> tuple[float, float, float]:
    """(seconds to the first audio, seconds to the end, audio seconds) of one streamed request; ``first_only``: the
    request is cancelled at its first audio (the rest would only lengthen the run)."""
    from ..sampling_params import SamplingParams

    params = SamplingParams(seed=request["seed"], speaker=voice, lang=request["lang"])
    t0, first, samples = time.perf_counter(), None, 0
    async with contextlib.aclosing(engine.stream(request["text"], params)) as chunks:
        async for chunk in chunks:
            if first is None and len(chunk.audio):
                first = time.perf_counter() - t0
            samples += len(chunk.audio)
            if first is not None and first_only:
                break  # closing the stream aborts the request
    end = time.perf_counter() - t0
    return (end if first is None else first), end, samples / engine.sample_rate


async def _round(engine, reqs: list[dict[str, Any]], five: str, voice: str | None) -> dict[str, Any]:
    # The single request is also the five-sentence text's first sentence alone.
    _, single, _ = await _one(engine, reqs[0], voice)
    t0 = time.perf_counter()
    results = await asyncio.gather(*(_one(engine, r, voice) for r in reqs[1:]))
    concurrent = time.perf_counter() - t0
    first, _, _ = await _one(engine, {**reqs[0], "text": five}, voice, first_only=True)
    await _idle(engine)  # the cancelled text's step in flight ends before anything else is timed
    return {"single_s": single, "concurrent_s": concurrent, "first_audio_s": first,
            "audio_s": [a for _, _, a in results]}


async def _idle(engine, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while (stats := engine.stats()).num_running or stats.num_waiting:
        if time.monotonic() > deadline:
            raise RuntimeError("the engine did not drain after a cancelled request")
        await asyncio.sleep(0.05)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from .. import models
    from ..cpu import probe
    from ..engine.async_engine import AsyncEngine

    if args.rounds < 1:
        raise ValueError("--rounds must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    family = models.detect(args.model, args.family)
    script = reference_script(family) if args.reference_python else None
    ckpt = family.resolve(args.model)
    load_before = os.getloadavg()
    config = engine_config(args, max_num_seqs=max(8, args.requests))
    engine = AsyncEngine.from_pretrained(ckpt, args.device, config, family=family.name)
    try:
        voice = engine.engine.voices.voice(args.voice) if args.voice else None
        reqs, five = requests(args.lang, args.requests, args.voice)
        asyncio.run(_one(engine, reqs[3], voice))  # warm-up: G2P dictionaries, kernels
        ours, package = [], []
        for _ in range(args.rounds):
            ours.append(asyncio.run(_round(engine, reqs, five, voice)))
            if script is not None:
                jobs = {"threads": torch.get_num_threads(), "rounds": 1, "requests": reqs}
                package.append(run_reference(args.reference_python, script, ckpt, jobs))
    finally:
        engine.shutdown()
    med = lambda key, rows: round(statistics.median(r[key] if not isinstance(r[key], list) else r[key][0]  # noqa: E731
                                                    for r in rows), 4)
    audio = sum(ours[0]["audio_s"])
    out: dict[str, Any] = {
        "bench": "family",
        "family": family.name,
        "model": str(args.model),
        "device": args.device,
        "precision": args.precision,
        "audio_dtype": args.audio_dtype,
        "threads": torch.get_num_threads(),
        "cpu": probe().describe(),
        "load_avg_before": [round(x, 2) for x in load_before],
        "load_avg_after": [round(x, 2) for x in os.getloadavg()],
        "rounds": args.rounds,
        "requests": len(reqs) - 1,
        "ours": {
            "single_s": med("single_s", ours),
            "concurrent_s": med("concurrent_s", ours),
            "concurrent_audio_s": round(audio, 3),
            "concurrent_audio_s_per_s": round(audio / med("concurrent_s", ours), 4),
            "first_audio_s": med("first_audio_s", ours),
            "rounds": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k != "audio_s"}
                       for r in ours],
        },
    }
    out["first_audio_over_first_sentence"] = round(out["ours"]["first_audio_s"] / out["ours"]["single_s"], 3)
    if package:
        ref_audio = sum(package[0]["audio_s"][1:])
        ref = {
            "package": package[0].get("package"),
            "single_s": med("single_s", package),
            "sequential_s": med("sequential_s", package),
            "sequential_audio_s": round(ref_audio, 3),
            "sequential_audio_s_per_s": round(ref_audio / med("sequential_s", package), 4),
            "rounds": [{"single_s": p["single_s"][0], "sequential_s": p["sequential_s"][0]} for p in package],
        }
        out["reference"] = ref
        out["single_speedup"] = round(ref["single_s"] / out["ours"]["single_s"], 3)
        out["concurrent_speedup"] = round(out["ours"]["concurrent_audio_s_per_s"] / ref["sequential_audio_s_per_s"], 3)
    return out


def main(args: argparse.Namespace) -> int:
    return run_tool(args, run)
