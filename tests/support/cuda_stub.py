"""Stand-in ``torch.cuda`` calls for CPU tests of the CUDA path: every call is recorded with the device
it names (or, for calls that take none, the thread's stand-in current device), so a test can assert
that an engine on ``cuda:1`` never touches another card. Tensors stay on the CPU: pinned allocations,
copies to a CUDA device and ``torch.empty`` / ``zeros`` / ``full`` on one are CPU ones, and graphs
record nothing (``replay`` does nothing unless a test gives the ``FakeGraph`` something to do).

    calls = FakeCuda.install(monkeypatch)
    ...  # code under test, with a CUDA device label
    assert calls.devices() == {torch.device("cuda", 1)}
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch

CPU = torch.device("cpu")


def _dev(d) -> torch.device:
    d = torch.device(d) if not isinstance(d, torch.device) else d
    return torch.device("cuda", 0) if d.type == "cuda" and d.index is None else d


class FakeStream:
    """A stream of one device; ``uid`` tells pool streams apart."""

    _next = 0

    def __init__(self, device=None, priority: int = 0, *, calls: FakeCuda | None = None) -> None:
        assert calls is not None
        self.calls = calls
        self.device = _dev(device) if device is not None else calls.current()
        FakeStream._next += 1
        self.uid = FakeStream._next

    def wait_stream(self, other: FakeStream) -> None:
        self.calls.add("wait_stream", self.device)
        assert other.device == self.device, f"stream of {self.device} waits on {other.device}"

    def wait_event(self, event: FakeEvent) -> None:
        self.calls.add("wait_event", self.device)

    def synchronize(self) -> None:
        self.calls.add("stream.synchronize", self.device)

    def record_event(self, event: FakeEvent | None = None) -> FakeEvent:
        event = event or FakeEvent(calls=self.calls)
        event.record(self)
        return event


class FakeEvent:
    def __init__(self, *a, calls: FakeCuda | None = None, **k) -> None:
        assert calls is not None
        self.calls = calls
        self.device: torch.device | None = None

    def record(self, stream: FakeStream | None = None) -> None:
        self.device = stream.device if stream is not None else self.calls.current()
        self.calls.add("event.record", self.device)

    def synchronize(self) -> None:
        assert self.device is not None, "waited on an event never recorded"
        self.calls.add("event.synchronize", self.device)

    def query(self) -> bool:
        return True


class FakeGraph:
    """A CUDAGraph stand-in: ``on_replay`` (if set) runs at each replay."""

    def __init__(self, *a, calls: FakeCuda | None = None, **k) -> None:
        assert calls is not None
        self.calls = calls
        self.on_replay = None
        self.replays = 0
        self.capture_stream: FakeStream | None = None
        self.reset_called = False

    def replay(self) -> None:
        self.calls.add("graph.replay", self.calls.current())
        self.replays += 1
        if self.on_replay is not None:
            self.on_replay()

    def pool(self):
        return ("pool", id(self))

    def reset(self) -> None:
        self.reset_called = True


class FakeCuda:
    """The record of every stand-in call: ``(name, device)``, and each thread's current device."""

    def __init__(self) -> None:
        self.log: list[tuple[str, torch.device]] = []
        self._local = threading.local()
        self.streams: list[FakeStream] = []
        self.graphs: list[FakeGraph] = []
        self.captures: list[tuple[FakeGraph, FakeStream | None, dict]] = []
        self.pinned_ptrs: set[int] = set()
        """Data pointers of the host tensors pinned under the stand-in (``h2d`` vs ``h2d blocking``)."""

    def current(self) -> torch.device:
        return getattr(self._local, "device", torch.device("cuda", 0))

    def add(self, name: str, device: torch.device) -> None:
        self.log.append((name, device))

    def devices(self) -> set[torch.device]:
        return {d for _, d in self.log}

    def named(self, name: str) -> list[torch.device]:
        return [d for n, d in self.log if n == name]

    @classmethod
    def install(cls, monkeypatch) -> FakeCuda:
        calls = cls()

        def set_device(d) -> None:
            calls._local.device = _dev(d)
            calls.add("set_device", _dev(d))

        @contextmanager
        def device(d):
            before = calls.current()
            calls._local.device = _dev(d)
            calls.add("device", _dev(d))
            try:
                yield
            finally:
                calls._local.device = before

        def new_stream(device=None, priority=0):
            s = FakeStream(device, priority, calls=calls)
            calls.add("Stream", s.device)
            calls.streams.append(s)
            return s

        def current_stream(device=None):
            d = _dev(device) if device is not None else calls.current()
            calls.add("current_stream" if device is not None else "current_stream()", d)
            return FakeStream(d, calls=calls)

        @contextmanager
        def stream(s):
            calls.add("stream", s.device if s is not None else calls.current())
            yield

        def new_graph(*a, **k):
            g = FakeGraph(calls=calls)
            calls.graphs.append(g)
            return g

        @contextmanager
        def graph(g, pool=None, stream=None, **kw):
            calls.add("graph", stream.device if stream is not None else calls.current())
            g.capture_stream = stream
            calls.captures.append((g, stream, kw))
            yield

        def synchronize(device=None):
            calls.add("synchronize", _dev(device) if device is not None else calls.current())

        real_empty, real_to, real_pin = torch.empty, torch.Tensor.to, torch.Tensor.pin_memory
        real_zeros, real_full = torch.zeros, torch.full

        def on_cpu(k: dict) -> dict:  # a device tensor: recorded, allocated on the CPU
            if "device" in k and str(k["device"]).startswith("cuda"):
                calls.add("alloc", _dev(k["device"]))
                k = {**k, "device": CPU}
            return k

        def empty(*a, pin_memory=False, **k):
            t = real_empty(*a, **on_cpu(k))
            if pin_memory:
                calls.add("pinned", calls.current())
                calls.pinned_ptrs.add(t.data_ptr())
            return t

        def pin_memory(self, *a, **k):
            calls.add("pinned", calls.current())
            pinned = self.clone()
            calls.pinned_ptrs.add(pinned.data_ptr())
            return pinned

        def to(self, *a, **k):  # a copy to a CUDA device: recorded, done on the CPU
            cuda = [x for x in (*a, k.get("device")) if isinstance(x, torch.device | str) and str(x).startswith("cuda")]
            if cuda:  # "h2d": from pinned memory without blocking; anything else makes the host wait
                quiet = k.get("non_blocking", False) and self.data_ptr() in calls.pinned_ptrs
                calls.add("h2d" if quiet else "h2d blocking", _dev(cuda[0]))
            a = tuple(CPU if isinstance(x, torch.device | str) and str(x).startswith("cuda") else x for x in a)
            if "device" in k and str(k["device"]).startswith("cuda"):
                k["device"] = CPU
            k.pop("non_blocking", None)
            return real_to(self, *a, **k)

        class Event(FakeEvent):  # a class, as torch's: ``Event.record`` can be wrapped
            def __init__(self, *a, **k) -> None:
                super().__init__(calls=calls)

        for name, value in {
            "set_device": set_device,
            "device": device,
            "Stream": new_stream,
            "current_stream": current_stream,
            "stream": stream,
            "Event": Event,
            "CUDAGraph": new_graph,
            "graph": graph,
            "graph_pool_handle": lambda: ("pool", "handle"),
            "synchronize": synchronize,
        }.items():
            monkeypatch.setattr(torch.cuda, name, value)
        monkeypatch.setattr(torch, "empty", empty)
        monkeypatch.setattr(torch, "zeros", lambda *a, **k: real_zeros(*a, **on_cpu(k)))
        monkeypatch.setattr(torch, "full", lambda *a, **k: real_full(*a, **on_cpu(k)))
        monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
        monkeypatch.setattr(torch.Tensor, "to", to)
        del real_pin
        return calls
