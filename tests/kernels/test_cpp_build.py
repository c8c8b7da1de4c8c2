"""The C++ ops' shared build step says why it cannot build, and never raises."""

from __future__ import annotations

from pathlib import Path

from chattts_serve.kernels import cpp_build


def test_no_compiler_or_no_ninja_is_a_reason_not_an_error(monkeypatch):
    monkeypatch.setattr(cpp_build, "find_compiler", lambda: None)
    assert cpp_build.build("never_built", Path("missing.cpp"), []) == "no C++ compiler on the PATH"
    monkeypatch.setattr(cpp_build, "find_compiler", lambda: "/usr/bin/c++")
    monkeypatch.setattr(cpp_build.shutil, "which", lambda name: None)
    assert cpp_build.build("never_built", Path("missing.cpp"), []) == "ninja is not installed"


def test_a_failed_build_is_a_reason(monkeypatch):
    import torch.utils.cpp_extension as ext

    def fail(**kwargs):
        raise RuntimeError("Error building extension 'never_built'\nld: cannot find -lfoo")

    monkeypatch.setattr(cpp_build, "find_compiler", lambda: "/usr/bin/c++")
    monkeypatch.setattr(cpp_build.shutil, "which", lambda name: "/usr/bin/" + name)
    monkeypatch.setattr(ext, "load", fail)
    why = cpp_build.build("never_built", Path("missing.cpp"), [])
    assert why is not None and why.startswith("its build failed (RuntimeError") and "cannot find -lfoo" in why
