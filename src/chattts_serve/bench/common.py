"""What the in-process bench tools share: model flags, the texts, peak memory, and the reference's
side run as a subprocess in its own environment (``reference_driver.py``, one JSON line back)."""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..engine.config import FLAT_OPTIONS, EngineConfig, add_engine_arguments, engine_config_from_args
from ..engine.scheduler import SchedulerConfig
from . import stats

# ~10 s each when spoken; with random weights the length is fixed by --steps anyway.
TEXTS: tuple[str, ...] = (
    "四川美食确实以辣闻名，但也有不辣的选择，比如甜水面、赖汤圆、蛋烘糕、叶儿粑等，这些小吃口味温和，甜而不腻。",
    "The quick brown fox jumps over the lazy dog, then naps for a while in the warm afternoon sun by the river.",
    "今天天气真不错，我们一起去公园散步吧，顺便买一杯咖啡，再找个安静的地方坐下来聊聊天。",
    "Streaming speech synthesis sends the first audio while the rest of the sentence is still being generated.",
)
STEPS_10S = 469
"""Audio tokens in 10 s of speech (one token = 512 samples at 24 kHz), less the first 256-sample hop."""
REFERENCE_DRIVER = Path(__file__).resolve().parent / "reference_driver.py"


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="checkpoint directory or Hugging Face repo id")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    add_engine_flags(p)
    p.add_argument("--steps", type=int, default=STEPS_10S, help="audio tokens per text (min = max); 469 = 10 s")
    p.add_argument("--texts-file", default=None, help="UTF-8, one text per line (default: built-in texts)")
    p.add_argument("--plot", default=None, help="write a PNG here")
    p.add_argument(
        "--reference-python",
        default=None,
        help="python of an environment with chattts==0.2.5: also run the reference on the same texts, same "
        "checkpoint, in this run, and print ratios",
    )


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """The server's engine flags, spelled as ``serve`` spells them (``--precision``, ``--[no-]cuda-graphs``,
    ...), less the scheduler's limits: each tool sizes those from its own flags (``--steps``, ...)."""
    add_engine_arguments(p, skip=_TOOL_SIZED)


_TOOL_SIZED = tuple(name for name, path in FLAT_OPTIONS.items() if path[0] == "scheduler")


def engine_config(args: argparse.Namespace, **scheduler: int) -> EngineConfig:
    """The ``EngineConfig`` of the tool's engine flags and the given scheduler limits."""
    return engine_config_from_args(args, EngineConfig(scheduler=SchedulerConfig(**scheduler)))


def texts(args: argparse.Namespace, n: int) -> list[str]:
    """``n`` texts: the file's lines (or the built-in ones), cycled."""
    pool = list(TEXTS)
    if args.texts_file:
        pool = [t for t in Path(args.texts_file).read_text(encoding="utf-8").splitlines() if t.strip()]
        if not pool:
            raise ValueError(f"{args.texts_file} has no text lines")
    return [pool[i % len(pool)] for i in range(n)]


def peak_memory_mb(device: Any) -> dict[str, float]:
    """Peak resident memory of this process (includes loading), and of the GPU when on CUDA."""
    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = {"peak_rss_mb": round(rss_kb / 1024, 1)}
    if getattr(device, "type", str(device)).startswith("cuda"):
        import torch

        out["peak_cuda_mb"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    return out


def run_reference(
    python: str, mode: str, model: str, texts: list[str], steps: int, threads: int | None, timeout: float = 7200
) -> dict[str, Any]:
    """Run ``reference_driver.py MODE`` under ``python``; its last stdout line is the JSON result."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8", delete=False) as f:
        f.write("\n".join(texts) + "\n")
    # -I: the driver's folder must not go first on sys.path (its profile.py would shadow the stdlib one).
    cmd = [python, "-I", str(REFERENCE_DRIVER), mode, str(model), "--texts-file", f.name, "--steps", str(steps)]
    if threads:
        cmd += ["--threads", str(threads)]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    finally:
        Path(f.name).unlink(missing_ok=True)
    if res.returncode != 0:
        raise RuntimeError(f"reference run failed ({res.returncode}): {res.stderr.strip()[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def set_threads(args: argparse.Namespace) -> None:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)


def fail(msg: str) -> int:
    print(f"chattts-serve bench: error: {msg}", file=sys.stderr)
    return 2


def run_tool(
    args: argparse.Namespace,
    run: Callable[[argparse.Namespace], dict[str, Any]],
    plot: Callable[[dict[str, Any], str], bool] | None = None,
    markdown: Callable[[dict[str, Any]], str] | None = None,
) -> int:
    """The ``main`` of every in-process bench tool: fail before a long run if a plot was asked for and
    cannot be drawn, run, draw (``plot`` says whether it drew), print the ``markdown`` table where
    ``--markdown`` asks, then one JSON line. A ValueError (bad flags) exits 2 with its message."""
    plot_to = getattr(args, "plot", None)
    if plot_to:
        stats.require_matplotlib()
    try:
        result = run(args)
    except ValueError as exc:
        return fail(str(exc))
    from ..cpu import probe

    result.setdefault("cpu", probe().describe())  # every figure says which CPU it came from
    if plot_to and plot is not None and plot(result, plot_to):
        result["plot"] = plot_to
    if markdown is not None and getattr(args, "markdown", False):
        print(markdown(result))
    stats.emit(result)
    return 0


def wait_ready(base: str, proc: subprocess.Popen, timeout: float) -> None:
    """Wait until the ``chattts-serve serve`` that ``proc`` runs at ``base`` answers ``/ready`` with 200
    (model loaded); RuntimeError if it exits first or ``timeout`` seconds pass."""
    import time

    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:  # it died at start-up: say so now, not after the deadline
            raise RuntimeError(f"server exited with {proc.returncode} at start-up")
        try:
            if httpx.get(base + "/ready", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)  # loading: ask again, without hammering it
    raise RuntimeError(f"server did not become ready within {timeout:.0f} s")
