"""Building the package's small C++ CPU ops (``decode_attention.cpp``, ``int4_gemv.cpp``) at first use.

Each op is compiled by ``torch.utils.cpp_extension.load`` once per machine (cached per user under
``TORCH_EXTENSIONS_DIR``) and loaded into the process as a library of torch ops. A machine without a C++
compiler or ninja, or a build that fails, must not stop the engine: the caller keeps its torch path, and
says so in one warning naming the reason this function returns.
"""

from __future__ import annotations

import logging
import os
import shutil
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
