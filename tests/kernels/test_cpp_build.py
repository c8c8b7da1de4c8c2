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


def test_a_library_tries_once_warns_once_and_computes_its_flags_then(monkeypatch):
    """``Library``: the first ``loaded()`` builds (flags computed then), every later call answers from it; where
    it cannot run, one warning with the caller's fallback and the reason; ``fresh`` tries again."""
    import threading
    import warnings

    calls = []
    monkeypatch.setattr(cpp_build, "build", lambda name, source, flags: calls.append(flags) or None)
    lib = cpp_build.Library("never_built", Path("missing.cpp"), lambda: ["-O3", f"-D{len(calls)}"], "slower")
    threads = [threading.Thread(target=lib.loaded) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert lib.loaded() and calls == [["-O3", "-D0"]]

    unsupported = cpp_build.Library("never_built", Path("missing.cpp"), list, "on torch", lambda: "no AVX-512")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not unsupported.loaded() and not unsupported.loaded()
    assert [str(w.message) for w in caught] == ["on torch: no AVX-512"] and len(calls) == 1

    monkeypatch.setattr(cpp_build, "build", lambda name, source, flags: "ninja is not installed")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert lib.loaded()  # the answer of its one try
        again = lib.fresh()
        assert not again.loaded() and not again.loaded()
    assert [str(w.message) for w in caught] == ["slower: ninja is not installed"]
