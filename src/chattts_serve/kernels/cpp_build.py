"""Building the package's small C++ CPU ops (``decode_attention.cpp``, ``int4_gemv.cpp``, ``split_linear.cpp``)
at first use.

Each op is compiled by ``torch.utils.cpp_extension.load`` once per machine (cached per user under
``TORCH_EXTENSIONS_DIR``) and loaded into the process as a library of torch ops. A machine without a C++
compiler or ninja, or a build that fails, must not stop the engine: the caller keeps its torch path, and
says so in one warning naming the reason ``build`` returns. ``Library`` is that once-per-process load,
behind a lock, for each op module.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

LDFLAGS = ["-fopenmp"]
"""-fopenmp: at::parallel_for is an OpenMP pragma in torch's headers; without it an op runs on one thread.
The OpenMP runtime it links is the one torch has already loaded (same soname)."""


def find_compiler() -> str | None:
    """The C++ compiler torch.utils.cpp_extension would use ($CXX, else c++), if it is on the PATH."""
    return shutil.which(os.environ.get("CXX", "c++"))


def build(name: str, source: Path, cflags: list[str]) -> str | None:
    """Build (or load the cached build of) ``source`` as the op library ``name``; None when it is loaded,
    else why it could not be (for the caller's one warning)."""
    if find_compiler() is None:
        return "no C++ compiler on the PATH"
    if shutil.which("ninja") is None:
        return "ninja is not installed"
    try:
        from torch.utils.cpp_extension import load

        log.info("building the %s kernel (once per machine, ~30-60 s)", name)
        load(
            name=name,
            sources=[str(source)],
            extra_cflags=cflags,
            extra_ldflags=LDFLAGS,
            is_python_module=False,
            verbose=False,
        )
        return None
    except Exception as exc:  # a failed build must not stop the engine: the caller keeps torch's path
        return f"its build failed ({type(exc).__name__}: {str(exc).strip().splitlines()[-1:]})"


class Library:
    """One op library: built, or loaded from the per-user cache, at most once per process, on the first
    ``loaded()`` from any thread. Where it cannot run (``unsupported`` names why, or the build fails) one
    warning says ``fallback``: the reason, and ``loaded()`` is False from then on: the caller keeps its
    torch path. ``flags`` are computed at that first call (they may depend on the CPU)."""

    def __init__(
        self,
        name: str,
        source: Path,
        flags: Callable[[], list[str]],
        fallback: str,
        unsupported: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.name, self.source, self.fallback = name, source, fallback
        self._flags, self._unsupported = flags, unsupported
        self._lock = threading.Lock()
        self._loaded: bool | None = None

    def loaded(self) -> bool:
        with self._lock:
            if self._loaded is None:
                why = self._unsupported() or build(self.name, self.source, self._flags())
                if why is not None:
                    warnings.warn(f"{self.fallback}: {why}", RuntimeWarning, stacklevel=3)
                self._loaded = why is None
            return self._loaded

    def fresh(self) -> Library:
        """The same library not yet tried, as in a new process (tests; a library that did load is never
        loaded twice: its namespace would be registered again)."""
        return Library(self.name, self.source, self._flags, self.fallback, self._unsupported)
