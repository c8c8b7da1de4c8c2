"""The reference-exact fp32 path's one-row matmuls on every core, with MKL's own bits.

The fp32 mode with one KV slot runs the reference's ops (bit-exact with chattts): ``F.linear``, whose one-row
call is MKL's GEMV. On our AMD CPUs that GEMV runs on one thread whatever torch's thread count (Zen 4, 768 ->
6144: 1.70 ms at 1 thread, 1.77 at 2: ~11 GB/s, a third of what two cores read), so the decode step streams its
756 MB of weights from one core and is no faster than the reference's. Each output of the GEMV is one weight row
dotted with x, computed the same way wherever the row sits: the rows cut into one slice per thread (at multiples
of ``ALIGN``), each slice the same ``F.linear`` on its own thread, give the whole call's bits from every core.
That is checked, not assumed: ``split_linears_`` runs each weight shape both ways (on the weights themselves, two
and three slices and those of this thread count) and keeps ``F.linear`` for any shape whose bits differ.

Only one-row calls split (the decode step); a prompt's calls are MKL's GEMM, threaded already. The op is plain
C++ over ATen (``split_linear.cpp``), built at first use on any x86 CPU; without a compiler nothing changes.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from . import cpp_build

log = logging.getLogger(__name__)

ALIGN = 64
"""Slices start at multiples of this many rows (a GEMV that handles rows in blocks keeps its blocks)."""
_SOURCE = Path(__file__).with_name("split_linear.cpp")
_CFLAGS = ["-O2", "-fopenmp"]


_library = cpp_build.Library(
    "chattts_split_linear", _SOURCE, lambda: _CFLAGS, "the fp32 one-row matmuls stay on one core"
)


def available() -> bool:
    return _library.loaded()


def split_linear(x: torch.Tensor, weight: torch.Tensor, parts: int) -> torch.Tensor:
    """``F.linear(x, weight)`` for a contiguous fp32 ``x [rows, in]``, ``weight``'s rows in ``parts`` slices on
    as many threads."""
    return torch.ops.chattts_split_linear.split_linear(x, weight, parts, ALIGN)


class SplitLinear(nn.Linear):
    """An ``nn.Linear`` (no bias) whose one-row calls run ``split_linear`` on torch's threads; every other call,
    and any call on one thread, is ``F.linear``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = _parts(self.out_features)
        grad = torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)
        if parts < 2 or x.numel() != self.in_features or x.dtype != torch.float32 or grad:
            return F.linear(x, self.weight)
        y = split_linear(x.reshape(1, -1).contiguous(), self.weight, parts)
        return y.reshape(*x.shape[:-1], self.out_features)


def _parts(out_features: int) -> int:
    """Slices of a one-row call now: one a thread, each at least ``ALIGN`` rows (< 2: no split)."""
    return min(torch.get_num_threads(), out_features // ALIGN)


def _splits_exactly(weight: torch.Tensor) -> bool:
    """Whether ``split_linear`` gives ``F.linear``'s bits for this weight: two and three slices, and the slices a
    call makes at this thread count (a bigger machine's more slices start at other rows)."""
    gen = torch.Generator().manual_seed(0)
    for parts in sorted({2, 3, _parts(weight.shape[0])}):
        if parts < 2 or weight.shape[0] // ALIGN < parts:
            continue
        x = torch.randn(1, weight.shape[1], generator=gen)
        if not torch.equal(split_linear(x, weight, parts), F.linear(x, weight)):
            return False
    return True


def split_linears_(module: nn.Module) -> int:
    """Swap every bias-free fp32 CPU ``nn.Linear`` under ``module`` (wide enough to split, and whose shape splits
    with the same bits) for a ``SplitLinear`` sharing its weight; returns how many. Nothing where the op cannot
    be built."""
    if not available():
        return 0
    checked: dict[tuple[int, int], bool] = {}
    swaps = []
    for parent in module.modules():
        for name, child in parent.named_children():
            if type(child) is not nn.Linear or child.bias is not None or child.out_features < 2 * ALIGN:
                continue
            w = child.weight
            if w.dtype != torch.float32 or w.device.type != "cpu" or not w.is_contiguous():
                continue
            shape = tuple(w.shape)
            if shape not in checked:
                with torch.no_grad():
                    checked[shape] = _splits_exactly(w.detach())
                if not checked[shape]:
                    log.warning("fp32 %s matmul: split rows differ from F.linear here; it stays on one core", shape)
            if checked[shape]:
                swaps.append((parent, name, child))
    for parent, name, child in swaps:
        split = SplitLinear(child.in_features, child.out_features, bias=False, device="meta")
        split.weight = child.weight
        setattr(parent, name, split)
    return len(swaps)
