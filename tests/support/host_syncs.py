"""Count the ops that make the host wait for the device on CUDA, on any device (the CPU included):
reading a value back (``.item()``, ``bool(t)``, ``torch.equal``), and ops whose output size depends on
device values (``nonzero``, boolean-mask indexing, ``masked_select``, ``repeat_interleave`` without
``output_size``), and explicit waits (``Event.synchronize``, ``Stream.synchronize``,
``torch.cuda.synchronize``: ``counting_waits``). Host-to-device copies are not counted (on the CPU they
cannot be told apart; ``tests/support/cuda_stub.py`` tells pinned from pageable ones)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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


@contextmanager
def counting_waits(counts: Counter[str]) -> Iterator[None]:
    """Count every host wait on the device the dispatcher never sees: ``synchronize`` of an event or a
    stream (whatever ``torch.cuda.Event`` / ``Stream`` are now: the real ones, or the stand-ins of
    ``cuda_stub``) and ``torch.cuda.synchronize``, each as ``counts["wait"]``."""
    patched: list[tuple[Any, str, Any]] = []

    def wrap(owner: Any, name: str) -> None:
        real = getattr(owner, name)

        def counted(*a, **k):
            counts["wait"] += 1
            return real(*a, **k)

        try:
            setattr(owner, name, counted)
        except (TypeError, AttributeError):  # a C type: its Python subclass is patched instead
            return
        patched.append((owner, name, real))

    from .cuda_stub import FakeEvent, FakeStream

    owners = []
    for cls in (torch.cuda.Event, torch.cuda.Stream, FakeEvent, FakeStream):
        if isinstance(cls, type):  # under the stand-ins ``torch.cuda.Stream`` is a function
            owners += [c for c in cls.__mro__ if "synchronize" in vars(c)][:1]  # the one that runs
    for owner in dict.fromkeys(owners):
        wrap(owner, "synchronize")
    wrap(torch.cuda, "synchronize")
    try:
        yield
    finally:
        for owner, name, real in reversed(patched):
            setattr(owner, name, real)


class HostSyncCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self._waits = counting_waits(self.counts)

    def __enter__(self):
        self._waits.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        self._waits.__exit__(None, None, None)
        return super().__exit__(*exc)

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
