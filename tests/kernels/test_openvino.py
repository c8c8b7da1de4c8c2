"""kernels.openvino: a compiled model freed on another thread must not leave the compiling thread's signal stack
dangling (the process then dies on its next SIGTERM). Each case runs in a subprocess: the failure is a crash."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("openvino")

SCRIPT = textwrap.dedent(
    """
    import gc, os, signal, sys, threading, time
    import numpy as np
    import openvino as ov
    from chattts_serve.kernels import openvino

    p = ov.opset13.parameter([1, 64], np.float32)
    model = ov.Model([ov.opset13.relu(p)], [p])
    config = {"INFERENCE_NUM_THREADS": 1}
    if sys.argv[1] == "plugin":
        compiled = ov.Core().compile_model(model, "CPU", config)
    else:
        compiled = openvino.compile_model(model, config)
    assert float(compiled(np.ones((1, 64), np.float32))[0].sum()) == 64.0
    box = [compiled]
    del compiled
    freer = threading.Thread(target=lambda: (box.clear(), gc.collect()))  # freed elsewhere, as a GC may
    freer.start(), freer.join()
    got = []
    signal.signal(signal.SIGTERM, lambda *a: got.append(1))
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.05)
    print("handled" if got else "missed")
    """
)


def _run(how: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, how], capture_output=True, text=True, timeout=120)


def test_a_model_compiled_here_and_freed_elsewhere_leaves_signals_working():
    done = _run("ours")
    assert done.returncode == 0 and done.stdout.strip() == "handled", done.stderr[-2000:]


def test_the_plugin_called_directly_crashes_on_the_next_signal():
    """The defect the module works around, where this OpenVINO and CPU have it (the plugin sets the stack for its
    own kernels: not every CPU gets it). If it stops crashing everywhere, the workaround can go."""
    done = _run("plugin")
    if done.returncode == 0:
        pytest.skip("this OpenVINO on this CPU leaves the compiling thread's signal stack alone")
    assert done.returncode == -11, (done.returncode, done.stdout, done.stderr[-2000:])
