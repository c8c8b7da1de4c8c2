"""server/gc_freeze.py: what is alive at a server's start-up is out of the collector's walks while it runs.

The freeze is process-wide and the test harness freezes its own heap first (conftest), so the behaviour of a
server process is checked in fresh interpreters."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap

from chattts_serve.server import gc_freeze
from chattts_serve.server.gc_freeze import frozen_start_up

_PRELUDE = """
import gc, weakref
from chattts_serve.server.gc_freeze import frozen_start_up

class Object:  # instances carry a __dict__: the collector tracks them
    pass

def walked(obj):  # frozen objects are in no generation gc.get_objects lists
    return any(o is obj for o in gc.get_objects())

def cycle():
    c = Object()
    c.self = c
    return weakref.ref(c)
"""


def _in_a_fresh_process(body: str) -> None:
    code = _PRELUDE + textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_a_server_freezes_what_is_alive_at_start_up_until_the_last_one_stops():
    _in_a_fresh_process(
        """
        alive = Object()
        assert walked(alive) and gc.get_freeze_count() == 0
        with frozen_start_up():
            assert not walked(alive)
            later = Object()
            assert walked(later)
            with frozen_start_up():  # a second server in the process
                assert not walked(later)
            assert not walked(alive) and not walked(later)  # the first one still runs
        assert walked(alive) and walked(later) and gc.get_freeze_count() == 0
        """
    )


def test_garbage_is_collected_before_the_freeze_and_while_serving():
    _in_a_fresh_process(
        """
        before = cycle()  # unreachable, not yet collected: freezing it would keep it for good
        with frozen_start_up():
            assert before() is None
            during = cycle()
            gc.collect()
            assert during() is None
        """
    )


def test_a_heap_frozen_by_someone_else_is_left_as_it_was():
    _in_a_fresh_process(
        """
        owned = Object()
        gc.freeze()  # the process's own policy (the test harness does this)
        frozen = gc.get_freeze_count()
        alive = Object()
        with frozen_start_up():
            assert walked(alive) and gc.get_freeze_count() == frozen
        assert not walked(owned) and gc.get_freeze_count() == frozen
        """
    )


def test_in_the_harness_a_server_leaves_the_harness_freeze_alone():
    frozen = gc.get_freeze_count()
    assert frozen > 0  # conftest's
    with frozen_start_up():
        assert gc.get_freeze_count() == frozen
    assert gc.get_freeze_count() == frozen


def test_the_apps_lifespan_holds_the_start_up_freeze(server):
    # `server` is the tests' in-process app (conftest): its lifespan has run and not yet stopped.
    assert gc_freeze._servers >= 1
