"""The CPU this process runs on: one probe, read once, that every kernel choice and every benchmark uses.

The fast path differs by CPU (2-core boxes here are AVX2-only EPYCs, Zen 4 with AVX-512 VNNI and BF16, or
Sapphire Rapids with AMX): bf16 is native only with AVX-512 BF16 or AMX, ORT's int8 kernel needs VNNI to
use full-range weights, and the ``ort-auto`` crossover and the decode-attention kernel depend on the
vector units. Linux's /proc/cpuinfo says all of it; elsewhere the probe knows only the architecture, and
every choice falls back to its safe default.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class CpuInfo:
    model: str
    """"AMD EPYC 9B14", "Intel(R) Xeon(R) Platinum 8481C", ... ("unknown" where not readable)."""
    arch: str
    """``platform.machine()``: "x86_64", "aarch64", ..."""
    flags: frozenset[str]
    """The kernel's feature flags (/proc/cpuinfo), empty where not readable."""
    cores: int
    """CPUs this process may run on."""

    @property
    def avx2(self) -> bool:
        return "avx2" in self.flags

    @property
    def avx512(self) -> bool:
        return "avx512f" in self.flags

    @property
    def vnni(self) -> bool:
        """int8 dot products that accumulate in int32 (AVX-512 VNNI or AVX-VNNI)."""
        return bool({"avx512_vnni", "avx_vnni"} & self.flags)

    @property
    def bf16(self) -> bool:
        """Native bf16 arithmetic (AVX-512 BF16 or AMX): elsewhere oneDNN emulates it, slower than fp32."""
        return bool({"avx512_bf16", "amx_bf16"} & self.flags)

    @property
    def amx(self) -> bool:
        return "amx_int8" in self.flags

    @property
    def arm(self) -> bool:
        return self.arch.lower() in ("aarch64", "arm64")

    @property
    def kind(self) -> str:
        """The CPU's class for per-CPU tables: "amx", "avx512_vnni", "avx2" or "other"."""
        if self.amx:
            return "amx"
        if "avx512_vnni" in self.flags:
            return "avx512_vnni"
        if self.avx2:
            return "avx2"
        return "other"

    def describe(self) -> dict[str, object]:
        """What a benchmark records with its figures."""
        units = [u for u in ("avx2", "avx512", "vnni", "bf16", "amx") if getattr(self, u)]
        return {"model": self.model, "arch": self.arch, "kind": self.kind, "units": units, "cores": self.cores}


def parse_cpuinfo(text: str, arch: str | None = None, cores: int | None = None) -> CpuInfo:
    """``CpuInfo`` from the text of /proc/cpuinfo (the first processor's fields)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor is enough: the others are the same part
            continue
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    return CpuInfo(
        model=fields.get("model name", "unknown"),
        arch=arch if arch is not None else platform.machine(),
        flags=frozenset(fields.get("flags", "").split()),
        cores=cores if cores is not None else _cores(),
    )


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@functools.cache
def probe() -> CpuInfo:
    """This machine's CPU (read once per process)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    return parse_cpuinfo(text)
