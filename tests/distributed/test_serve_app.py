"""``ray serve``'s process lifecycle (distributed/serve_app.py ``serve_forever``) without a cluster: Ray's
calls are replaced by fakes that do what matters here (``ray.init`` installs its own SIGTERM handler)."""

from __future__ import annotations

import os
import signal
import sys
import threading

import pytest

pytest.importorskip("ray")

from chattts_serve.distributed import serve_app  # noqa: E402
from chattts_serve.distributed.settings import ServeSettings  # noqa: E402


class FakeRay:
    def __init__(self, deploy_s: float = 0.0) -> None:
        self.calls: list[str] = []
        self.deploy_s = deploy_s
        self.deployed = threading.Event()

    def connect(self, address, num_cpus=None) -> None:
        self.calls.append("connect")

        def ray_sigterm(signum, frame):  # what ray.init's head node installs
            print("SIGTERM received", file=sys.stderr)
            sys.exit(1)

        signal.signal(signal.SIGTERM, ray_sigterm)

    def deploy(self, settings):
        self.calls.append("deploy")
        threading.Event().wait(self.deploy_s)  # a model load: interruptible by a signal
        self.calls.append("deployed")
        self.deployed.set()
        return [settings]


@pytest.fixture
def fake(monkeypatch):
    def make(**kwargs) -> FakeRay:
        ray = FakeRay(**kwargs)
        monkeypatch.setattr(serve_app, "connect", ray.connect)
        monkeypatch.setattr(serve_app, "deploy", ray.deploy)
        monkeypatch.setattr(serve_app.ray, "is_initialized", lambda: True)
        monkeypatch.setattr(serve_app.ray, "shutdown", lambda: ray.calls.append("ray.shutdown"))
        monkeypatch.setattr(serve_app.serve, "delete", lambda name: ray.calls.append(f"delete {name}"))
        monkeypatch.setattr(serve_app.serve, "shutdown", lambda: ray.calls.append("serve.shutdown"))
        return ray

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield make
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


def _signal_when(event: threading.Event | None, sig: int, delay_s: float = 0.2) -> None:
    def later() -> None:
        if event is not None:
            event.wait(10)
        threading.Event().wait(delay_s)
        os.kill(os.getpid(), sig)

    threading.Thread(target=later, daemon=True).start()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_deletes_the_applications_and_exits_0(fake, sig):
    ray = fake()
    _signal_when(ray.deployed, sig)
    assert serve_app.serve_forever(ServeSettings(name="app"), address=None) == 0
    assert ray.calls == ["connect", "deploy", "deployed", "delete app", "serve.shutdown", "ray.shutdown"]


def test_sigterm_while_deploying_stops_at_once_and_leaves_a_joined_cluster_running(fake):
    ray = fake(deploy_s=30)
    _signal_when(None, signal.SIGTERM, delay_s=0.5)
    assert serve_app.serve_forever(ServeSettings(name="app"), address="auto") == 0
    assert ray.calls == ["connect", "deploy", "delete app", "ray.shutdown"]  # no serve.shutdown: not ours


@pytest.mark.parametrize(
    ("flags", "warned"),
    [
        (("--host", "0.0.0.0"), True),
        (("--host", "0.0.0.0", "--api-keys", "k1"), False),
        (("--host", "127.0.0.1"), False),
    ],
)
def test_ray_serve_warns_when_open_to_anyone(tiny_ckpt, monkeypatch, caplog, flags, warned):
    from chattts_serve.cli import main

    monkeypatch.setattr(serve_app, "serve_forever", lambda settings, address, num_cpus=None: 0)
    with caplog.at_level("WARNING"):
        assert main(["ray", "serve", "--model", str(tiny_ckpt), *flags]) == 0
    assert ("without API keys" in caplog.text) == warned
