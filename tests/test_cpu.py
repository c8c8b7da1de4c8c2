"""The one CPU probe: /proc/cpuinfo's first processor, and the classes every per-CPU choice uses."""

from __future__ import annotations

import pytest

from chattts_serve.cpu import parse_cpuinfo, probe

ZEN4 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC 9B14
flags\t\t: fpu sse2 avx2 fma avx512f avx512_vnni avx512_bf16

processor\t: 1
model name\t: something else entirely
flags\t\t: fpu
"""


def test_the_first_processor_is_read():
    cpu = parse_cpuinfo(ZEN4, arch="x86_64", cores=2)
    assert cpu.model == "AMD EPYC 9B14" and cpu.cores == 2
    assert cpu.avx2 and cpu.avx512 and cpu.vnni and cpu.bf16 and not cpu.amx and not cpu.arm
    assert cpu.kind == "avx512_vnni"
    assert (cpu.vendor, cpu.family, cpu.model_number, cpu.core) == ("AuthenticAMD", 25, 17, "zen4")
    assert cpu.describe() == {
        "model": "AMD EPYC 9B14",
        "arch": "x86_64",
        "kind": "avx512_vnni",
        "units": ["avx2", "avx512", "vnni", "bf16"],
        "vendor": "AuthenticAMD",
        "family": 25,
        "model_number": 17,
        "core": "zen4",
        "cores": 2,
    }


@pytest.mark.parametrize(
    ("vendor", "family", "flags", "core"),
    [
        ("AuthenticAMD", "25", "avx2 avx512f", "zen4"),  # a VM's "AMD EPYC": the family tells Zen 4 ...
        ("AuthenticAMD", "26", "avx2 avx512f", "zen5"),  # ... from Zen 5
        ("AuthenticAMD", "25", "avx2", ""),  # Zen 3: no AVX-512
        ("GenuineIntel", "6", "avx2 avx512f amx_int8", ""),
        ("AuthenticAMD", "", "avx2 avx512f", ""),  # no family field
    ],
)
def test_the_family_names_the_amd_core(vendor, family, flags, core):
    text = f"processor\t: 0\nvendor_id\t: {vendor}\ncpu family\t: {family}\nflags\t\t: {flags}\n"
    cpu = parse_cpuinfo(text, arch="x86_64")
    assert cpu.core == core and cpu.family == (int(family) if family else None)
    assert ("core" in cpu.describe()) is bool(core)


@pytest.mark.parametrize(
    ("flags", "kind", "bf16", "vnni"),
    [
        ("avx2 avx512f avx512_vnni amx_tile amx_int8 amx_bf16", "amx", True, True),
        ("avx2 avx512f avx512_vnni avx512_bf16", "avx512_vnni", True, True),
        ("avx2 fma avx_vnni", "avx2", False, True),
        ("avx2 fma", "avx2", False, False),
        ("", "other", False, False),
    ],
)
def test_classes(flags, kind, bf16, vnni):
    cpu = parse_cpuinfo(f"processor\t: 0\nflags\t\t: {flags}\n", arch="x86_64")
    assert (cpu.kind, cpu.bf16, cpu.vnni) == (kind, bf16, vnni)


def test_unreadable_cpuinfo_knows_nothing():
    cpu = parse_cpuinfo("", arch="aarch64")
    assert cpu.model == "unknown" and not cpu.flags and cpu.kind == "other" and cpu.arm


def test_probe_reads_this_machine_once():
    assert probe() is probe()
    assert probe().cores >= 1
