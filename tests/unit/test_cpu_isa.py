"""The cpu platform's ISA levels (quire/platforms/cpu/isa.py): which level a CPU gets,
``/proc/cpuinfo`` parsing, the ``isa`` option, and builds keyed by level.

Feature sets are those Linux reports on real CPUs (trimmed to what matters). The kernels
of every level this host runs are checked against their references by the kernel tests
themselves (``tests/unit/conftest.py``'s ``kernels`` fixture is parametrized by level).
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
from quire.platforms.cpu import native as native_module
from quire.platforms.cpu.isa import (
    LEVEL_NAMES,
    CpuFeatures,
    best_level,
    detect,
    levels_for,
    parse_cpuinfo,
)
from quire.platforms.cpu.native import load_native_kernels
from quire.platforms.cpu.options import CpuOptions
from quire.platforms.cpu.platform import CpuPlatform

X86 = levels_for("x86_64")
ARM = levels_for("aarch64")
AVX512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
#: gcc's -m names that differ from /proc/cpuinfo's
GCC_NAMES = {"avx512bf16": "avx512_bf16", "avx512vnni": "avx512_vnni",
             "amx-tile": "amx_tile", "amx-bf16": "amx_bf16", "amx-int8": "amx_int8"}
CPUS = {
    "zen3": CpuFeatures.of("x86_64", {"avx2", "fma"}),
    "zen4": CpuFeatures.of("x86_64", {"avx2", "fma", *AVX512, "avx512_bf16",
                                      "avx512_vnni"}),
    "sapphire_rapids": CpuFeatures.of("x86_64", {
        "avx2", "fma", *AVX512, "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16",
        "amx_int8", "amx_tile"}),
    "sandy_bridge": CpuFeatures.of("x86_64", {"avx"}),  # AVX but no AVX2
    "avx512_without_bw": CpuFeatures.of("x86_64", {"avx2", "fma", "avx512f"}),  # Xeon Phi
    "graviton2": CpuFeatures.of("aarch64", {"asimd", "asimdhp", "asimddp"}),
    "graviton3": CpuFeatures.of("aarch64", {"asimd", "asimdhp", "asimddp", "sve", "bf16",
                                            "i8mm"}),
    "raspberry_pi4": CpuFeatures.of("aarch64", {"asimd"}),
}
EXPECTED = {"zen3": "avx2", "zen4": "avx512_bf16", "sapphire_rapids": "amx",
            "sandy_bridge": "generic", "avx512_without_bw": "avx2", "graviton2": "neon",
            "graviton3": "neon", "raspberry_pi4": "generic"}

ZEN4_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9654 96-Core Processor
flags\t\t: fpu vme sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 bmi2 avx512f avx512dq \
avx512cd avx512bw avx512vl avx512_bf16 avx512_vnni avx512vbmi
bugs\t\t: sysret_ss_attrs

processor\t: 1
flags\t\t: fpu
"""
GRAVITON3_CPUINFO = """processor\t: 0
BogoMIPS\t: 2100.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid \
asimdrdm jscvt fcma lrcpc dcpop sha3 sm3 sm4 asimddp sha512 sve asimdfhm i8mm bf16 dgh rng
CPU implementer\t: 0x41
"""


@pytest.mark.parametrize("cpu", list(CPUS))
def test_each_cpu_gets_its_best_level(cpu: str) -> None:
    features = CPUS[cpu]
    assert best_level(features, levels_for(features.machine)).name == EXPECTED[cpu]


def test_a_lower_level_may_be_forced() -> None:
    assert best_level(CPUS["zen4"], X86, forced="avx2").name == "avx2"
    assert best_level(CPUS["zen4"], X86, forced="generic").name == "generic"
    assert best_level(CPUS["graviton3"], ARM, forced="generic").name == "generic"


def test_a_level_the_cpu_lacks_is_refused_naming_what_is_missing() -> None:
    with pytest.raises(ValueError, match=r"'avx512'.*avx512bw, avx512dq, avx512f, avx512vl"):
        best_level(CPUS["zen3"], X86, forced="avx512")
    with pytest.raises(ValueError, match=r"'avx2'.*avx2, fma"):
        best_level(CPUS["sandy_bridge"], X86, forced="avx2")
    with pytest.raises(ValueError,
                       match=r"'neon'.*levels here: generic, avx2, avx512, avx512_bf16, amx"):
        best_level(CPUS["zen4"], X86, forced="neon")


def test_levels_are_ordered_and_their_flags_enable_only_what_they_need() -> None:
    assert [level.name for level in X86] == ["generic", "avx2", "avx512", "avx512_bf16",
                                          "amx"]
    assert [level.name for level in ARM] == ["generic", "neon"]
    for lower, higher in zip(X86, X86[1:]):
        assert lower.needs < higher.needs
    for level in X86:
        assert level.flags[0] == "-march=x86-64"  # the baseline, plus one -m per feature
        # (the compiler's name for a feature, where it is not /proc/cpuinfo's)
        assert {GCC_NAMES.get(f, f) for f in (f.removeprefix("-m") for f in level.flags[1:])
                } == level.needs
    assert set(LEVEL_NAMES) == {"generic", "avx2", "avx512", "avx512_bf16", "amx",
                                "neon"}
    unknown = levels_for("riscv64")  # the compiler's default target only
    assert [(lv.name, lv.flags) for lv in unknown] == [("generic", ())]
    assert best_level(CpuFeatures(machine="riscv64"), unknown).name == "generic"
    assert levels_for("AMD64") == X86 and levels_for("arm64") == ARM


def test_cpuinfo_is_parsed_on_x86_and_arm() -> None:
    zen4 = parse_cpuinfo(ZEN4_CPUINFO, "x86_64")
    assert zen4.present == {"fma", "avx2", *AVX512, "avx512_bf16", "avx512_vnni"}
    assert zen4.machine == "x86_64" and not zen4.amx_tile
    graviton = parse_cpuinfo(GRAVITON3_CPUINFO, "aarch64")
    assert graviton.present == {"asimd", "asimdhp", "asimddp", "sve", "i8mm", "bf16"}
    assert parse_cpuinfo("processor\t: 0\n", "x86_64").present == frozenset()


def test_detect_reads_the_file_and_says_why_it_assumes_nothing(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(GRAVITON3_CPUINFO)
    assert detect(cpuinfo, machine="arm64") == parse_cpuinfo(GRAVITON3_CPUINFO, "aarch64")
    with caplog.at_level(logging.INFO, logger="quire.platforms.cpu.isa"):
        missing = detect(tmp_path / "absent", machine="x86_64")
        assert missing == CpuFeatures(machine="x86_64")
        assert "cpu features unknown" in caplog.text and "absent" in caplog.text
        caplog.clear()
        cpuinfo.write_text("processor\t: 0\n")
        assert detect(cpuinfo, machine="x86_64").present == frozenset()
        assert "lists none" in caplog.text


def test_the_isa_option_is_checked_and_read_from_its_variable() -> None:
    assert CpuOptions().isa is None
    assert CpuOptions.parse({"isa": "AVX2"}, {}).isa == "avx2"
    assert CpuOptions.parse({}, {"QUIRE_CPU_ISA": "generic"}).isa == "generic"
    with pytest.raises(ValueError, match=r"isa='avx3'.*generic, avx2, avx512, avx512_bf16, amx, neon"):
        CpuOptions(isa="avx3")
    with pytest.raises(ValueError, match="QUIRE_CPU_ISA"):
        CpuOptions.parse({}, {"QUIRE_CPU_ISA": "sse"})


def test_the_platform_passes_the_option_on(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}

    def fake_load(**kwargs):
        seen.update(kwargs)
        return None

    monkeypatch.setattr("quire.platforms.cpu.platform.load_native_kernels", fake_load)
    platform = CpuPlatform()
    platform.configure({"isa": "avx2"})
    assert platform._native_kernels() is None
    assert seen == {"enabled": True, "isa": "avx2"}


# -- builds ---------------------------------------------------------------------------------

needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler on this host")


@needs_cc
def test_builds_are_keyed_by_level_not_by_the_host(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    if levels_for(detect().machine) != X86:
        pytest.skip("builds x86 levels")
    monkeypatch.setattr(native_module, "detect", lambda: CPUS["zen3"])
    on_zen3 = load_native_kernels(tmp_path, prebuilt=None)
    generic = load_native_kernels(tmp_path, isa="generic", prebuilt=None)
    assert on_zen3 is not None and generic is not None
    assert (on_zen3.level, generic.level) == ("avx2", "generic")
    assert on_zen3.has_panel_gemm and not generic.has_panel_gemm  # the kernel needs AVX2
    monkeypatch.setattr(native_module, "detect", lambda: CPUS["sapphire_rapids"])
    forced = load_native_kernels(tmp_path, isa="avx2", prebuilt=None)  # another host
    assert forced is not None and forced.path == on_zen3.path
    assert sorted(p.name.split("-")[1] for p in tmp_path.iterdir()) == ["avx2", "generic"]
    with pytest.raises(ValueError, match="avx512"):
        monkeypatch.setattr(native_module, "detect", lambda: CPUS["zen3"])
        load_native_kernels(tmp_path, isa="avx512")


@needs_cc
def test_it_loads_the_best_level_of_this_cpu_and_logs_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    features = detect()
    best = best_level(features, levels_for(features.machine))
    with caplog.at_level(logging.INFO, logger=native_module.__name__):
        loaded = load_native_kernels(tmp_path)
    assert loaded is not None and loaded.level == best.name
    assert f"ISA level {best.name}" in caplog.text


@needs_cc
def test_a_level_the_compiler_cannot_build_falls_back_to_a_lower_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    if levels_for(detect().machine) != X86:
        pytest.skip("builds x86 levels")
    monkeypatch.setattr(native_module, "detect", lambda: CPUS["zen4"])
    real = native_module._build

    def old_compiler(compiler, cache_root, level):
        if level.name.startswith("avx512"):
            raise OSError("cc: unrecognized option -mavx512bw")
        return real(compiler, cache_root, level)

    monkeypatch.setattr(native_module, "_build", old_compiler)
    loaded = load_native_kernels(tmp_path, prebuilt=None)
    assert loaded is not None and loaded.level == "avx2"
    assert "ISA level avx512_bf16 unavailable" in caplog.text
    assert "ISA level avx512 unavailable" in caplog.text
    # forced: that level or none, never another one
    assert load_native_kernels(tmp_path, isa="avx512", prebuilt=None) is None


@needs_cc
@pytest.mark.parametrize("rows", [*range(1, 14), 131, 300])
@pytest.mark.parametrize("out_features", [8, 37, 64, 80, 200])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_avx512_panel_kernel_sums_as_the_avx2_one(tmp_path_factory: pytest.TempPathFactory,
                                                      rows: int, out_features: int,
                                                      with_bias: bool) -> None:
    """Same FMAs in the same order, 16 lanes to a register instead of 8 and up to 4
    panels to a tile instead of 1: equal bit for bit, rows read in place (1-13) or
    packed (131, 300), N below one panel, a multiple of 64, and with 2- and 1-panel
    groups (37, 80, 200). Each level's kernel against float64 is
    tests/unit/test_cpu_panel_gemm.py."""
    features = detect()
    if features.machine != "x86_64" or X86[2].missing(features):
        pytest.skip("this CPU does not run the avx512 level")
    cache = tmp_path_factory.getbasetemp() / "isa-panel-kernels"
    avx2 = load_native_kernels(cache, isa="avx2")
    avx512 = load_native_kernels(cache, isa="avx512")
    assert avx2 is not None and avx512 is not None
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, 100, generator=gen)
    x = torch.randn(rows, 100, generator=gen)
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    panels = avx2.pack_panels(weight)
    assert torch.equal(avx2.panel_linear(x, panels, out_features, bias),
                       avx512.panel_linear(x, panels, out_features, bias))
