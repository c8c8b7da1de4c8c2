"""OpenVINO's CPU plugin, compiled so that it cannot break signal delivery.

The plugin's ``compile_model`` gives the calling thread an alternate signal stack (``sigaltstack``) that belongs to
the compiled model. When that model is freed on another thread (a garbage collection, the engine thread, a request
handler), the calling thread's alternate stack is left pointing at freed memory, and the next signal delivered to
that thread (CPython installs its handlers with ``SA_ONSTACK``) kills the process with a kernel SIGSEGV: a server's
SIGTERM, a Ctrl-C. Compiling on a short-lived thread of its own leaves every lasting thread's signal stack alone;
inference does not touch it. ``tests/kernels/test_openvino.py`` reproduces the crash with the plugin called
directly.
"""

from __future__ import annotations

import contextlib
import io
import logging
import threading
from collections.abc import Iterator
from typing import Any


def compile_model(model: Any, config: dict[str, Any], core: Any = None) -> Any:
    """``core.compile_model(model, "CPU", config)`` on a thread that ends when it returns (see the module)."""
    import openvino as ov

    core = core if core is not None else ov.Core()
    result: list[Any] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            result.append(core.compile_model(model, "CPU", config))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread as it is
            failure.append(exc)

    thread = threading.Thread(target=run, name="openvino-compile")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]


@contextlib.contextmanager
def quiet_nncf() -> Iterator[None]:
    """nncf's statistics (INFO logs) and progress bars kept out of the process's output: its log at WARNING,
    and stdout (where rich prints the bars whatever the log level, and where a tool's JSON line goes) swallowed
    for the duration. For every nncf call in the package (Kokoro's int8 decoder, the ov-int8 audio graph)."""
    from nncf.common.logging import nncf_logger

    level = nncf_logger.level
    nncf_logger.setLevel(logging.WARNING)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        nncf_logger.setLevel(level)
