"""Shared fixtures. Tests run on CPU with one torch thread (timings on shared 2-core machines drift,
and tests check behaviour, not speed)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

torch.set_num_threads(1)
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach the network


def _share_httpx_tls_context() -> None:
    """httpx parses certifi's CA bundle into a new SSLContext for every client it makes (~20 ms of CPU), and
    ``httpx.get`` / ``post`` and each OpenAI SDK client make one per call: over the tier, seconds of CPU for plain
    HTTP to 127.0.0.1 (the polls of a starting server most of all, which then compete with it). The default
    context is made once and shared (a context is safe to share between clients); any other ``verify`` or
    ``cert`` gets what httpx makes of it."""
    import functools

    import httpx._transports.default as transports

    make = getattr(transports, "create_ssl_context", None)
    if make is None:  # another httpx: its own way, only slower
        return
    default = functools.cache(make)

    def create_ssl_context(verify=True, cert=None, trust_env=True):
        if verify is True and cert is None:
            return default(True, None, trust_env)
        return make(verify=verify, cert=cert, trust_env=trust_env)

    transports.create_ssl_context = create_ssl_context


_share_httpx_tls_context()

TINY_SEED = 0

TIERED_MARKERS = ("integration", "e2e", "ray", "fuzz", "soak", "slow")
"""Left out of the default (fast) tier; ``--all`` runs them too."""


def pytest_addoption(parser):
    parser.addoption("--all", action="store_true", help="run every tier: also " + ", ".join(TIERED_MARKERS))


FAST_TIER = pytest.StashKey[bool]()


def pytest_configure(config):
    """The fast tier by default: unless ``--all``, a ``-m`` expression, or only named test files or ids
    (a test asked for by name runs whatever its tier)."""
    named = config.args and all(".py" in arg for arg in config.args)
    if not (config.getoption("all") or config.option.markexpr or named):
        config.option.markexpr = "not (" + " or ".join(TIERED_MARKERS) + ")"
        config.stash[FAST_TIER] = True


_EXIT_STATUS = pytest.StashKey[int]()


def pytest_sessionfinish(session, exitstatus):
    """Names the threads still alive after the last test (a thread left running is the first suspect when the
    process then crashes in its teardown), and keeps the session's status for ``pytest_unconfigure``."""
    import threading

    session.config.stash[_EXIT_STATUS] = int(exitstatus)
    alive = [t for t in threading.enumerate() if t is not threading.main_thread()]
    if alive:
        names = ", ".join(f"{t.name}{' (daemon)' if t.daemon else ''}" for t in alive)
        print(f"\nthreads alive after the session: {names}", file=sys.stderr)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """The test process ends here, with pytest's status: its exit handlers run (pytest's own: the temporary
    directories' locks and pruning; Ray's shutdown), then it exits without the rest of the interpreter's
    teardown, which frees the modules and unloads a dozen native runtimes loaded into this one process (torch,
    ONNX Runtime, OpenVINO + nncf, Ray, Playwright) in whatever order they come. CI once crashed there
    (SIGSEGV after "2933 passed"; not reproduced here, on another CPU). Nothing it does is under test: the
    server's and the CLI's own exits are, in their own processes (tests/server/test_limits_and_ops.py,
    tests/test_cli.py). An xdist worker still reports to its controller after this hook: it ends as usual."""
    if hasattr(config, "workerinput") or _EXIT_STATUS not in config.stash:
        return
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(config.stash[_EXIT_STATUS])


def pytest_collection_finish(session):
    """Once collected, the heap holds what every test shares: torch, the package, the test modules and their
    libraries. Each full garbage collection walked all of it (~0.1-0.2 s of CPU, dozens of times over the tier,
    ~7 % of a run's CPU); frozen (``gc.freeze``), those objects are left out of later collections, and they live
    as long as the run anyway. Garbage made later is collected as before (refcounts, and cycles by the GC)."""
    import gc

    gc.collect()
    gc.freeze()


def pytest_ignore_collect(collection_path, config):
    """In the fast tier, a module whose ``pytestmark`` puts every test of it in a left-out tier is not even
    imported: its tests would all be deselected, and importing it costs seconds of CPU (schemathesis, ray,
    the agent frameworks) for nothing. None: pytest decides as usual."""
    if not config.stash.get(FAST_TIER, False) or not collection_path.name.startswith("test_"):
        return None
    return True if collection_path.suffix == ".py" and module_tiers(collection_path) else None


def module_tiers(path) -> set[str]:
    """The tiered markers (``TIERED_MARKERS``) a test module's own ``pytestmark`` applies to all its tests:
    ``pytest.mark.NAME``, alone or in a list or tuple, read from the source without importing it."""
    import ast

    source = path.read_text(encoding="utf-8")
    if "pytestmark" not in source:
        return set()
    tiers: set[str] = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
            marks = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value]
            tiers |= {ast.unparse(m).removeprefix("pytest.mark.") for m in marks} & set(TIERED_MARKERS)
    return tiers


@pytest.fixture
def two_threads():
    """torch on 2 threads for one test (the harness keeps 1), then back."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """The tiny random checkpoint (official layout), written once per test run."""
    from chattts_serve.models.chattts.random_checkpoint import write_random

    return write_random(tmp_path_factory.mktemp("ckpt") / "tiny", "tiny", seed=TINY_SEED)


@pytest.fixture(scope="session")
def onnx_cache_dir(tmp_path_factory) -> str:
    """One ONNX export cache for the run: tests/models/chattts/test_onnx.py writes the tiny checkpoint's exports
    under their cache keys and the ort-* engines of later tests find them there (built once, not twice)."""
    return str(tmp_path_factory.mktemp("onnx-cache"))


@pytest.fixture(scope="session")
def tiny_engine(tiny_ckpt):
    from chattts_serve import Engine
    from chattts_serve.engine.config import EngineConfig

    return Engine.from_pretrained(tiny_ckpt, device="cpu", config=EngineConfig.with_slots(8))
