"""Counts, on the CPU, the ops that would make the host wait for a CUDA device, and the kernel launches.

A ``TorchDispatchMode`` sees every aten op a block of code runs. On CUDA these wait for the device
(or copy through pageable memory):

- ``item``: ``aten._local_scalar_dense`` (``.item()``, ``int(t)``, ``bool(t)``, ``if t:``; under
  inference mode ``aten.item`` / ``aten.is_nonzero``), ``equal``, ``allclose``;
- ``nonzero`` and ``masked_select`` (their output size is data-dependent);
- ``bool_index``: ``index`` / ``index_put_`` with a boolean mask (a nonzero inside);
- ``repeat_interleave``: with tensor repeats and no ``output_size`` (it sums the repeats on the host);
- ``from_python``: ``aten.lift_fresh`` (``torch.tensor(list)``: host data that then crosses pageable);
- ``tolist``: ``Tensor.tolist`` on anything but a registered host buffer (it dispatches no op, so it
  is patched while counting);
- ``d2h``: a copy into a registered host buffer: the one transfer a step is allowed;
- ``wait``: ``Event.synchronize``, ``Stream.synchronize``, ``torch.cuda.synchronize`` (patched while
  counting, stand-in CUDA events included: ``tests/support/host_syncs.counting_waits``).

Limits: what never reaches the dispatcher on the CPU (``.cpu()`` / ``.to(device)`` of a CPU tensor,
``from_numpy``) is invisible here; the GPU check's ``torch.cuda.set_sync_debug_mode`` covers it.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.support.host_syncs import counting_waits

aten = torch.ops.aten

_ALWAYS = {
    aten._local_scalar_dense.default: "item",
    # Under inference_mode (the runner's) these composite ops reach the mode undecomposed.
    aten.item.default: "item",
    aten.is_nonzero.default: "item",
    aten.equal.default: "item",
    aten.allclose.default: "item",
    aten.nonzero.default: "nonzero",
    aten.nonzero_numpy.default: "nonzero",
    aten.argwhere.default: "nonzero",
    aten.masked_select.default: "masked_select",
    aten.lift_fresh.default: "from_python",
    aten.lift_fresh_copy.default: "from_python",
}
_REPEAT = {aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor}
_INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}


def _has_bool_index(indices) -> bool:
    return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices)


class SyncCounter(TorchDispatchMode):
    def __init__(self, host_buffers: tuple[torch.Tensor, ...] = ()) -> None:
        super().__init__()
        self._host = [(b.untyped_storage().data_ptr(), b.untyped_storage().nbytes()) for b in host_buffers]
        self.syncs: Counter[str] = Counter()
        self.ops = 0
        """Non-view ops: each is at least one kernel launch on a device."""

    def _is_host_buffer(self, t: torch.Tensor) -> bool:
        ptr = t.untyped_storage().data_ptr()
        return any(start <= ptr < start + size for start, size in self._host)

    @property
    def total(self) -> int:
        return sum(self.syncs.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _ALWAYS.get(func)
        if func in _INDEXING and _has_bool_index(args[1]):
            kind = "bool_index"
        elif func in _REPEAT and kwargs.get("output_size") is None:
            kind = "repeat_interleave"
        elif func is aten.copy_.default and self._is_host_buffer(args[0]):
            kind = "d2h"
        if kind:
            self.syncs[kind] += 1
        if not func.is_view:
            self.ops += 1
        return func(*args, **kwargs)

    def __enter__(self):
        counter, original = self, torch.Tensor.tolist
        self._tolist = original

        def tolist(t):
            if not counter._is_host_buffer(t):
                counter.syncs["tolist"] += 1
            return original(t)

        torch.Tensor.tolist = tolist
        self._waits = counting_waits(self.syncs)
        self._waits.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        self._waits.__exit__(None, None, None)
        return super().__exit__(*exc)
