"""CUDA graphs of a batch family's bucket-padded forward, one per (rows bucket, length bucket).

A batch family (Kokoro, VITS) runs a step's utterances as one padded forward on an accelerator
(``engine.batch.pads_rows``); its shapes vary with every batch, so it cannot replay a graph as it stands.
Padded up to a bucket (rows to a power of two, length to a power of two) with each row's true length a device
tensor (``kernels.lengths.DeviceLengths``: the masks make the padding invisible), the forward repeats a few
shapes and takes no host value: it can be captured once per bucket at start-up and replayed.

This module is the machinery every family shares; a family says only what its forward is, its static inputs at
a bucket, and a random batch to check a graph with (``BucketGraphs``'s three callables). Capture goes through the
engine's ``GraphStore`` (one capture stream and pool, refused graphs kept until close) and each graph is checked
once against the same forward run eagerly (``cuda_graph.graph_matches_eager``: the static output poisoned with
NaN, then replayed); one that differs, or whose capture fails, is refused (``strict``: raises) and its bucket runs
eagerly, as does a batch longer than the largest length bucket. Largest buckets are captured first so the smaller
ones reuse the pool. The time and memory the captures took are logged.

Static inputs are allocated once per length bucket at its largest rows bucket; the smaller rows buckets' graphs
read row slices of them. Each replay zeroes them, sets every row's length to 1 (rows past the batch: finite,
ignored), then lets the family write its rows: a graph sees nothing of the previous batch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from ..device import on_device
from .cuda_graph import GraphStore, doublings, graph_matches_eager

logger = logging.getLogger(__name__)

Static = dict[str, torch.Tensor]
"""A bucket's static inputs by name; ``"lengths"`` (int64 [rows]) is every family's."""


def length_buckets(largest: int, smallest: int) -> list[int]:
    """Powers of two from ``smallest`` up to the first at or past ``largest``: a batch pads its length by
    at most 2x, and there are few enough buckets (5 for 64..1024) to capture each at start-up."""
    if smallest < 1 or largest < smallest:
        raise ValueError(f"length buckets need 1 <= smallest <= largest, got {smallest}, {largest}")
    return doublings(largest, smallest, round_up=True)


def grid(rows: list[int], lengths: list[int], max_work: int | None) -> list[tuple[int, int]]:
    """Every (rows, length) bucket whose padded work ``rows * length`` stays within ``max_work`` (the memory a
    capture holds grows with it), the smallest rows bucket kept at every length; largest first."""
    keep = [(r, n) for n in lengths for r in rows if max_work is None or r * n <= max_work or r == rows[0]]
    return sorted(keep, key=lambda b: (b[1], b[0]), reverse=True)


def wanted(device: torch.device | str, config: Any) -> bool:
    """Whether a batch family captures its graphs: on CUDA with ``--cuda-graphs`` (the default), as ChatTTS."""
    return torch.device(device).type == "cuda" and config.runner.cuda_graphs


class BucketGraphs:
    def __init__(
        self,
        name: str,
        device: torch.device,
        forward: Callable[[Static], torch.Tensor],
        inputs: Callable[[int, int], Static],
        probe: Callable[[Static, int, torch.Generator], None],
        rows: list[int],
        lengths: list[int],
        max_work: int | None = None,
        strict: bool = False,
        tolerance: tuple[float, float] | None = None,
        store: GraphStore | None = None,
        capture: Callable[[Callable[[], torch.Tensor]], tuple[Any, torch.Tensor]] | None = None,
    ) -> None:
        """``forward(static)``: the bucket-padded forward of the static inputs (row slices of them), its output
        [rows, ...]; it must take no host value from the device. ``inputs(rows, length)``: fresh static inputs
        at a bucket. ``probe(static, length, generator)``: fill them with a random batch of ragged rows (each
        length in 1..length) for the self-check, drawn on the device (``generator`` is the device's).
        ``max_work``: the largest ``rows * length`` captured. ``tolerance``: (rtol, atol) of the self-check
        (None: by the output's dtype). ``capture``: how one call is captured, returning (graph, static output)
        (None: the store's CUDA capture; tests pass a stand-in)."""
        self.name, self.device = name, torch.device(device)
        self.forward, self.inputs, self.probe = forward, inputs, probe
        self.rows, self.lengths = sorted(rows), sorted(lengths)
        self.buckets = grid(self.rows, self.lengths, max_work)
        self.strict, self.tolerance = strict, tolerance
        self.store = store if store is not None else GraphStore(self.device)
        self._capture = capture if capture is not None else self.store.capture
        self.graphs: dict[tuple[int, int], tuple[Any, torch.Tensor]] = self.store.table(name)
        self._static: dict[int, Static] = {}
        self.replays = 0
        """Graph replays (a batch wider than the largest rows bucket replays once per piece)."""
        self.eager = 0
        """Batches run eagerly: longer than the largest bucket, or a bucket without a graph (refused)."""
        self.refused = 0
        """Captured graphs that failed their self-check."""
        self.capture_s = 0.0
        self.capture_bytes = 0
        self.diffs: dict[tuple[int, int], float] = {}
        """Each bucket's self-check: max |replay - eager| (refused ones included)."""

    # ------------------------------------------------------------------ start-up

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Every bucket's graph, largest first (one pool), each checked once against the eager forward."""
        cuda = self.device.type == "cuda"
        reserved = torch.cuda.memory_reserved(self.device) if cuda else 0
        t0 = time.perf_counter()
        bad = []
        with on_device(self.device):
            for rows, length in self.buckets:
                if length not in self._static:
                    self._static[length] = self.inputs(rows, length)  # the largest rows bucket comes first
                static = self._view(length, rows)
                self._reset(static)
                try:
                    graph, out = self._capture(lambda static=static: self.forward(static))
                except RuntimeError as exc:  # an op CUDA cannot capture: that bucket runs eagerly
                    if self.strict:
                        raise
                    bad.append(f"rows {rows} length {length} (capture failed: {exc})")
                    continue
                gen = torch.Generator(device=self.device).manual_seed(rows * 7919 + length)
                self._reset(static)
                self.probe(static, length, gen)
                ok, diff = graph_matches_eager(graph.replay, out, lambda static=static: self.forward(static),
                                               self.tolerance)
                self.diffs[(rows, length)] = diff
                if ok:
                    self.graphs[(rows, length)] = (graph, out)
                else:
                    bad.append(f"rows {rows} length {length} (max diff {diff:.3g})")
                    self.store.retire(graph)
            if cuda:
                torch.cuda.synchronize(self.device)
        self.refused += len(bad)
        self.capture_s = time.perf_counter() - t0
        if cuda:
            self.capture_bytes = torch.cuda.memory_reserved(self.device) - reserved
        if bad:
            msg = f"{len(bad)} {self.name} CUDA graph(s) differ from the eager forward: " + ", ".join(bad)
            if self.strict:
                raise RuntimeError(msg)
            logger.warning("%s; those buckets run eagerly", msg)
        logger.info(
            "%s CUDA graphs: %d captured (%d refused) for rows %s x lengths %s in %.1f s, %.0f MiB",
            self.name, len(self.graphs), len(bad), self.rows, self.lengths, self.capture_s, self.capture_bytes / 2**20,
        )

    # ------------------------------------------------------------------ serving

    def length_bucket(self, need: int) -> int | None:
        """The smallest length bucket that holds ``need`` steps; None past the largest."""
        return next((n for n in self.lengths if n >= need), None)

    def pieces(self, n: int, need: int) -> list[tuple[int, int, int]] | None:
        """How a batch of ``n`` rows of at most ``need`` steps replays: (first row, rows, rows bucket) per
        replay, all at one length bucket; None when some piece has no graph (the batch runs eagerly)."""
        length = self.length_bucket(need)
        if length is None or n < 1:
            return None
        top = max((r for r, ln in self.graphs if ln == length), default=None)
        if top is None:
            return None
        out = []
        for lo in range(0, n, top):
            m = min(top, n - lo)
            rows = next((r for r in self.rows if r >= m and (r, length) in self.graphs), None)
            if rows is None:  # a refused bucket and none wider captured
                return None
            out.append((lo, m, rows))
        return out

    def usable(self, n: int, need: int) -> bool:
        """Whether ``run`` would replay graphs for this batch (asked before any per-request draw, so the
        eager path is chosen before the generators move)."""
        return self.pieces(n, need) is not None

    def note_eager(self) -> None:
        self.eager += 1

    @torch.inference_mode()
    def run(self, n: int, need: int, write: Callable[[Static, int, int], None]) -> list[torch.Tensor]:
        """Replay the graphs for a batch of ``n`` rows of at most ``need`` steps: ``write(static, first, rows)``
        puts the batch's rows ``first .. first + rows - 1`` in the static inputs' rows ``0 .. rows - 1`` (their
        lengths included). The outputs, one tensor of its own per piece (rows past the batch dropped)."""
        plan = self.pieces(n, need)
        if plan is None:
            raise ValueError(f"{self.name}: no graph for {n} rows of {need} steps (ask ``usable`` first)")
        length = self.length_bucket(need)
        outs = []
        with on_device(self.device):
            for lo, m, rows in plan:
                static = self._view(length, rows)
                self._reset(static)
                write(static, lo, m)
                graph, out = self.graphs[(rows, length)]
                graph.replay()
                self.replays += 1
                outs.append(out[:m].clone())  # the next replay rewrites ``out``
        return outs

    def counters(self) -> dict[str, int]:
        """For ``EngineStats`` (the Prometheus series ChatTTS's graphs feed too)."""
        return {"graph_replays": self.replays, "eager_steps": self.eager, "graphs_refused": self.refused}

    def describe(self) -> dict[str, Any]:
        """What the start-up did, for a report (the GPU check): buckets, refusals, the worst self-check."""
        return {
            "captured": len(self.graphs),
            "refused": self.refused,
            "rows": self.rows,
            "lengths": self.lengths,
            "capture_s": round(self.capture_s, 2),
            "capture_mib": round(self.capture_bytes / 2**20, 1),
            "max_replay_vs_eager": max(self.diffs.values(), default=None),
        }

    def _view(self, length: int, rows: int) -> Static:
        return {k: v[:rows] for k, v in self._static[length].items()}

    @staticmethod
    def _reset(static: Static) -> None:
        for name, t in static.items():
            if name == "lengths":
                t.fill_(1)
            else:
                t.zero_()
