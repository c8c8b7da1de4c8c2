"""A stand-in for a CUDA graph capture on the CPU, keeping the graph contract: the captured call's output is a
static buffer that each replay rewrites from the static inputs (what a CUDA graph does). ``works=False``: replays
do nothing, so a start-up self-check sees a stale (NaN-poisoned) output and must refuse the graph."""

from __future__ import annotations

from collections.abc import Callable

import torch


class StandInGraph:
    def __init__(self, fn: Callable[[], torch.Tensor], out: torch.Tensor, works: bool) -> None:
        self.fn, self.out, self.works = fn, out, works

    def replay(self) -> None:
        if self.works:
            self.out.copy_(self.fn())


class StandInCapture:
    def __init__(self, works: bool = True) -> None:
        self.works = works
        self.shapes: list[tuple[int, ...]] = []

    def __call__(self, fn: Callable[[], torch.Tensor]) -> tuple[StandInGraph, torch.Tensor]:
        out = fn()
        self.shapes.append(tuple(out.shape))
        return StandInGraph(fn, out, self.works), out
