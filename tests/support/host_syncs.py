"""Count the ops that make the host wait for the device on CUDA, on any device (the CPU included):
reading a value back (``.item()``, ``bool(t)``, ``torch.equal``), and ops whose output size depends on
device values (``nonzero``, boolean-mask indexing, ``masked_select``, ``repeat_interleave`` without
``output_size``). Host-to-device copies are not counted (on the CPU they cannot be told apart)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNCING = {
    "_local_scalar_dense",
    "is_nonzero",
    "equal",
    "nonzero",
    "masked_select",
    "repeat_interleave",
}


class HostSyncCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in SYNCING and not (name == "repeat_interleave" and (kwargs or {}).get("output_size") is not None):
            self.counts[name] += 1
        elif name == "index" and any(i is not None and i.dtype == torch.bool for i in args[1]):
            self.counts["index(bool mask)"] += 1
        elif name in ("index_put", "index_put_") and any(i is not None and i.dtype == torch.bool for i in args[1]):
            # ``x[mask] = v`` dispatches the in-place ``index_put_``
            self.counts["index_put(bool mask)"] += 1
        return func(*args, **(kwargs or {}))


def host_syncs(fn: Callable[[], Any]) -> tuple[Any, Counter[str]]:
    """``fn()``'s result and the syncing ops it ran, by name."""
    with HostSyncCounter() as counter:
        result = fn()
    return result, counter.counts
