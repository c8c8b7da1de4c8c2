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
    vendor: str = ""
    """``vendor_id``: "AuthenticAMD", "GenuineIntel" ("" where not readable)."""
    family: int | None = None
    """``cpu family`` (AMD: 25 = Zen 3/4, 26 = Zen 5); None where not readable."""
    model_number: int | None = None
    """``model`` (the number within the family); None where not readable."""

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
    def core(self) -> str:
        """The AMD core where the family says it (a VM's model name often does not: "AMD EPYC"): "zen4" (family 25
        with AVX-512, whose units run a 512-bit instruction as two 256-bit halves), "zen5" (family 26); else ""."""
        if self.vendor != "AuthenticAMD":
            return ""
        if self.family == 25 and self.avx512:
            return "zen4"
        return "zen5" if self.family == 26 else ""

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
        out: dict[str, object] = {"model": self.model, "arch": self.arch, "kind": self.kind, "units": units}
        if self.vendor:
            out.update(vendor=self.vendor, family=self.family, model_number=self.model_number)
        if self.core:
            out["core"] = self.core
        out["cores"] = self.cores
        return out


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
        vendor=fields.get("vendor_id", ""),
        family=_number(fields.get("cpu family")),
        model_number=_number(fields.get("model")),
    )


def _number(text: str | None) -> int | None:
    return int(text) if text is not None and text.isdigit() else None


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
