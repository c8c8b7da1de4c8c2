"""malloc.py: on glibc a CPU engine's big tensors come from the heap, not from fresh mappings."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from chattts_serve import malloc

# In a child process (the setting is process-wide): the bytes glibc has mapped for blocks of their own
# (mallinfo2's hblkhd) while a 64 MB tensor is alive, before and after ``keep_big_blocks``.
_PROBE = """
import ctypes, json, torch
from chattts_serve import malloc

class Info(ctypes.Structure):
    names = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
    _fields_ = [(n, ctypes.c_size_t) for n in names.split()]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info

def mapped_while_alive():
    before = libc.mallinfo2().hblkhd
    t = torch.empty(16 << 20)  # 64 MB of fp32
    t.fill_(1.0)
    return libc.mallinfo2().hblkhd - before

first = mapped_while_alive()
applied = malloc.keep_big_blocks()
print(json.dumps({"before": first, "applied": applied, "after": mapped_while_alive()}))
"""


def _glibc_with_mallinfo2() -> bool:
    import ctypes

    try:
        return hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2")
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _glibc_with_mallinfo2(), reason="glibc >= 2.33 only")
@pytest.mark.parametrize("mode", ["auto", "system"])
def test_big_tensors_come_from_the_heap_unless_told_otherwise(mode):
    env = {"CHATTTS_MALLOC": mode, "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["before"] >= 64 << 20  # glibc's default: a block that big is a mapping of its own
    if mode == "auto":
        assert got["applied"] is True and got["after"] == 0  # from the heap now
    else:
        assert got["applied"] is False and got["after"] >= 64 << 20


def test_a_bad_mode_is_refused(monkeypatch):
    monkeypatch.setenv(malloc.MODE_ENV, "jemalloc")
    malloc.keep_big_blocks.cache_clear()
    try:
        with pytest.raises(ValueError, match="CHATTTS_MALLOC must be 'auto' or 'system'"):
            malloc.keep_big_blocks()
    finally:
        malloc.keep_big_blocks.cache_clear()


def _vm_flags(addr: int) -> list[str]:
    """The VmFlags of the mapping holding ``addr`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.mark.skipif(
    not os.path.isdir("/sys/kernel/mm/transparent_hugepage"), reason="a Linux kernel with transparent huge pages"
)
def test_a_streamed_buffer_is_a_mapping_advised_for_huge_pages(monkeypatch):
    monkeypatch.setenv(malloc.MODE_ENV, "auto")
    t = malloc.huge_pages(5 << 20)
    assert t.dtype == torch.uint8 and t.shape == (5 << 20,)
    t.fill_(3)  # writable, and all of it there
    assert int(t[-1]) == 3
    assert "hg" in _vm_flags(t.data_ptr())  # advised, whether or not the kernel has huge pages free
    assert malloc.huge_pages(0).numel() == 0


def test_without_the_setting_a_streamed_buffer_is_a_plain_tensor(monkeypatch):
    # (Not checked through VmFlags: other libraries may advise the heap's pages themselves.)
    def no_mapping(*args, **kwargs):
        raise AssertionError("CHATTTS_MALLOC=system maps nothing of its own")

    monkeypatch.setenv(malloc.MODE_ENV, "system")
    monkeypatch.setattr(malloc.mmap, "mmap", no_mapping)
    t = malloc.huge_pages(5 << 20)
    assert t.dtype == torch.uint8 and t.shape == (5 << 20,)
