"""Small pure helpers every ``chattts-serve bench`` tool shares, so their numbers and output agree:
percentiles computed one way, one JSON line per run (greppable, appendable to a results file), and
optional PNG plots (matplotlib is an optional extra and is only imported when a plot is asked for)."""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

MATPLOTLIB_HINT = "plots need matplotlib: pip install matplotlib (or pip install 'chattts-serve[bench]')"


def snr_db(ref: Any, test: Any) -> float:
    """Signal-to-noise ratio of ``test`` against ``ref`` in dB, in float64 (inf when they are equal): the
    one quality figure every tool and test gives audio. numpy arrays or CPU tensors of any float dtype."""
    import numpy as np

    def f64(x: Any) -> Any:
        return x.detach().double().cpu().numpy() if hasattr(x, "detach") else np.asarray(x, dtype=np.float64)

    ref, test = f64(ref), f64(test)
    noise = float(((ref - test) ** 2).sum())
    return math.inf if noise == 0 else 10 * math.log10(float((ref**2).sum()) / noise)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between closest ranks (numpy's default),
    so small samples still give a p99 between the two largest values rather than snapping to one."""
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    if not values:
        raise ValueError("percentile of an empty sequence")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(values: Sequence[float]) -> dict[str, float | int | None]:
    """n, mean, min, p50, p90, p99, max of ``values``; all but n are None when there are none (a level where
    every request failed still has a well-formed summary)."""
    if not values:
        return {"n": 0, "mean": None, "min": None, "p50": None, "p90": None, "p99": None, "max": None}
    return {
        "n": len(values),
        "mean": sum(values) / len(values),
        "min": min(values),
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "max": max(values),
    }


def host_info() -> dict[str, Any]:
    """Where the numbers came from: results from different machines must not be compared blindly."""
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }


def torch_version() -> str | None:
    """The installed torch version, read from package metadata (importing torch would cost seconds)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:
        return None


def _json_safe(value: Any) -> Any:
    """NaN/inf are not JSON; they become null so every emitted line parses with any JSON reader."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def emit(result: Mapping[str, Any], stream: TextIO | None = None) -> None:
    """Print ``result`` as ONE JSON line (sorted keys) to stdout, adding "date" (UTC, ISO 8601), "torch" and
    "host" unless the result already has them; one line per run keeps results easy to append and grep."""
    out = dict(result)
    out.setdefault("date", datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    out.setdefault("torch", torch_version())
    out.setdefault("host", host_info())
    line = json.dumps(_json_safe(out), sort_keys=True, allow_nan=False, ensure_ascii=False)
    stream = sys.stdout if stream is None else stream
    stream.write(line + "\n")
    stream.flush()


def require_matplotlib() -> None:
    """Fail fast, before a long benchmark runs, when a plot was asked for but matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(MATPLOTLIB_HINT) from exc


@dataclass(frozen=True)
class Panel:
    """One subplot: named y-series over the shared x values (None: no value at that x)."""

    ylabel: str
    series: Mapping[str, Sequence[float | None]]


def save_plot(
    path: str | Path,
    x: Sequence[float],
    panels: Sequence[Panel],
    *,
    xlabel: str,
    title: str = "",
    logx: bool = False,
) -> Path:
    """Write a PNG with one subplot per panel, stacked and sharing the x axis. Uses the Agg canvas directly
    (no pyplot global state, no display needed, safe from any thread)."""
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not panels:
        raise ValueError("save_plot needs at least one panel")
    fig = Figure(figsize=(7, 2.6 * len(panels) + 0.6))
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, panel in zip(axes, panels, strict=True):
        for label, ys in panel.series.items():
            if len(ys) != len(x):
                raise ValueError(f"series {label!r} has {len(ys)} values for {len(x)} x values")
            ax.plot(list(x), [math.nan if y is None else y for y in ys], marker="o", label=label)
        ax.set_ylabel(panel.ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best", fontsize="small")
        if logx:
            ax.set_xscale("log", base=2)
    axes[-1].set_xlabel(xlabel)
    axes[-1].set_xticks(list(x))
    axes[-1].set_xticklabels([f"{v:g}" for v in x])
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=100)
    return path
