"""openmp.py: the thread that built an engine gives up its OpenMP pool, so the stepping thread's is not throttled."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from chattts_serve import openmp

pytestmark = pytest.mark.skipif(openmp._libgomp() is None, reason="torch runs on libgomp only on Linux builds")

# In a child process (pools are per thread, the throttling process-wide): a 2-thread region opens the main
# thread's pool (one more OS thread), ``release_pool`` ends it, and the thread's count of threads stays.
_POOL = """
import json, os, time, torch
from chattts_serve import openmp

torch.set_num_threads(2)
tasks = lambda: len(os.listdir("/proc/self/task"))
torch.ones(4).sum()  # torch's own start-up threads, if any, before the count
base = tasks()
x = torch.randn(1 << 22)
(x * 2).sum()  # 4 M elements: a parallel region on 2 threads
with_pool = tasks()
freed = openmp.release_pool()
deadline = time.monotonic() + 20
while tasks() > base and time.monotonic() < deadline:
    time.sleep(0.01)
after = tasks()
threads = torch.get_num_threads()
(x * 2).sum()
print(json.dumps({"base": base, "with_pool": with_pool, "freed": freed, "after": after,
                  "threads": threads, "again": tasks()}))
"""

# The reason: the main thread builds (its pool), another thread steps (a pool of its own): with both pools
# on 2 CPUs libgomp's idle threads sleep at every barrier. Voluntary context switches over 3000 regions.
_THROTTLE = """
import json, resource, sys, threading, torch
from chattts_serve import openmp

torch.set_num_threads(2)
(torch.randn(1 << 20) * 2).sum()  # the building thread's pool
if sys.argv[1] == "released":
    openmp.release_pool()
out = {}

def steps():
    y = torch.randn(1 << 17)
    torch.mul(y, 2)  # the stepping thread's pool
    before = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
    for _ in range(3000):
        torch.mul(y, 2)
    out["switches"] = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - before

t = threading.Thread(target=steps)
t.start()
t.join()
print(json.dumps(out))
"""


def _child(code: str, *args: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_release_pool_ends_the_calling_threads_pool_and_keeps_its_thread_count():
    r = _child(_POOL)
    assert r["with_pool"] == r["base"] + 1, r  # one pool thread beside the caller
    assert r["freed"] is True
    assert r["after"] == r["base"], r  # it ended
    assert r["threads"] == 2  # the thread's own count is untouched...
    assert r["again"] == r["base"] + 1, r  # ...and a new region gets a new pool


@pytest.mark.skipif(len(os.sched_getaffinity(0)) != 2, reason="the throttling shows where 3 pool threads share 2 CPUs")
def test_a_released_building_threads_pool_leaves_the_stepping_thread_unthrottled():
    kept = _child(_THROTTLE, "kept")["switches"]
    released = _child(_THROTTLE, "released")["switches"]
    assert kept >= 3000, kept  # throttled: the pool thread sleeps at (about) every barrier
    assert released < kept / 4, (kept, released)  # measured: ~5960 against 0


def test_release_pool_without_libgomp_does_nothing(monkeypatch):
    monkeypatch.setattr(openmp, "_libgomp", lambda: None)
    assert openmp.release_pool() is False
