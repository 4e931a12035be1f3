"""The cpu kernels the package build ships: built per ISA level into the wheel, preferred
at load time when they fit this CPU and the sources, never failing a build without a
compiler."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from quire.platforms.cpu import kernel_build
from quire.platforms.cpu import native as native_module
from quire.platforms.cpu.isa import CpuFeatures, best_level, detect, levels_for
from quire.platforms.cpu.native import load_native_kernels

ROOT = Path(__file__).resolve().parents[2]
needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler on this host")
MACHINE = detect().machine
ZEN3 = CpuFeatures.of("x86_64", ["avx2", "fma"])


@pytest.fixture(scope="module")
def prebuilt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every level of this machine built as the package build builds them."""
    out = tmp_path_factory.mktemp("prebuilt")
    built = kernel_build.build_prebuilt(out, MACHINE, levels_for(MACHINE), "cc")
    assert built == [level.name for level in levels_for(MACHINE)]
    return out


@needs_cc
def test_a_fitting_prebuilt_library_is_loaded_and_named(
        prebuilt: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    best = best_level(detect(), levels_for(MACHINE))
    with caplog.at_level(logging.INFO, logger=native_module.__name__):
        loaded = load_native_kernels(tmp_path, prebuilt=prebuilt)
    assert loaded is not None and loaded.level == best.name
    assert loaded.path == prebuilt / f"quire_cpu-{MACHINE}-{best.name}.so"
    assert list(tmp_path.iterdir()) == []  # nothing built here
    assert f"ISA level {best.name}, prebuilt: {loaded.path}" in caplog.text
    assert kernel_build.is_prebuilt(loaded.path)


@needs_cc
def test_a_prebuilt_level_this_cpu_lacks_is_skipped(
        prebuilt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if MACHINE != "x86_64":
        pytest.skip("x86 levels")
    assert (prebuilt / "quire_cpu-x86_64-avx512.so").exists()
    monkeypatch.setattr(native_module, "detect", lambda: ZEN3)
    loaded = load_native_kernels(tmp_path, prebuilt=prebuilt)
    assert loaded is not None and loaded.level == "avx2"
    assert loaded.path.parent == prebuilt


@needs_cc
def test_without_a_compiler_the_prebuilt_library_still_loads(
        prebuilt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("CC", "no-such-compiler-quire")
    loaded = load_native_kernels(tmp_path, prebuilt=prebuilt)
    assert loaded is not None and loaded.path.parent == prebuilt
    assert "no C compiler" not in caplog.text


@needs_cc
def test_a_stale_prebuilt_library_is_rebuilt_here(
        prebuilt: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    stale = tmp_path / "stale"
    shutil.copytree(prebuilt, stale)
    for manifest in stale.glob("*.json"):  # as if built from other sources
        data = json.loads(manifest.read_text())
        manifest.write_text(json.dumps({**data, "sources": "0" * 64}))
    cache = tmp_path / "cache"
    with caplog.at_level(logging.INFO, logger=native_module.__name__):
        loaded = load_native_kernels(cache, prebuilt=stale)
    assert loaded is not None and loaded.path.parent == cache
    assert not kernel_build.is_prebuilt(loaded.path)
    assert "stale: the C sources changed" in caplog.text
    assert "built here" in caplog.text


def test_a_changed_source_makes_the_library_stale(prebuilt: Path, tmp_path: Path) -> None:
    csrc = tmp_path / "csrc"
    shutil.copytree(kernel_build.CSRC, csrc)
    level = levels_for(MACHINE)[0]
    if not (prebuilt / kernel_build.prebuilt_name(MACHINE, level)).exists():
        pytest.skip("no C compiler on this host")
    assert kernel_build.find_prebuilt(prebuilt, MACHINE, level, csrc).path is not None
    header = kernel_build.headers(csrc)[0]
    header.write_text(header.read_text() + "\n/* edited */\n")
    found = kernel_build.find_prebuilt(prebuilt, MACHINE, level, csrc)
    assert found.path is None and "stale" in found.reason


def test_no_library_for_another_machine_or_a_missing_manifest(prebuilt: Path,
                                                              tmp_path: Path) -> None:
    level = levels_for(MACHINE)[0]
    assert kernel_build.find_prebuilt(prebuilt, "riscv64", level) == kernel_build.Prebuilt(None)
    name = kernel_build.prebuilt_name(MACHINE, level)
    if not (prebuilt / name).exists():
        pytest.skip("no C compiler on this host")
    shutil.copy(prebuilt / name, tmp_path / name)  # the library without its manifest
    found = kernel_build.find_prebuilt(tmp_path, MACHINE, level)
    assert found.path is None and "manifest" in found.reason


# -- the package build ----------------------------------------------------------------------

def _wheel(tmp_path: Path, env: dict[str, str] | None = None) -> Path:
    """The core distribution's wheel, built from a copy of the sources (no build files
    left in the shared checkout)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "core", src / "core", ignore=shutil.ignore_patterns(
        "__pycache__", "*.egg-info", "_prebuilt"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", str(src), "-w", str(tmp_path / "dist")],
                   check=True, capture_output=True, env=env, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("quire-*.whl")
    return wheel


def _compiles(level_flags: tuple[str, ...], tmp_path: Path) -> bool:
    source = tmp_path / "probe.c"
    source.write_text("int quire_probe(void) { return 0; }\n")
    return subprocess.run(["cc", *kernel_build.FLAGS, *level_flags, "-o",
                           str(tmp_path / "probe.so"), str(source)],
                          capture_output=True, check=False).returncode == 0


@needs_cc
@pytest.mark.slow
def test_the_wheel_holds_a_library_per_level_the_build_host_compiles(tmp_path: Path) -> None:
    wheel = _wheel(tmp_path)
    expected = {level.name for level in levels_for(MACHINE) if _compiles(level.flags, tmp_path)}
    assert expected
    with zipfile.ZipFile(wheel) as whl:
        names = whl.namelist()
        prefix = "quire/platforms/cpu/_prebuilt/"
        shipped = {n[len(prefix):] for n in names if n.startswith(prefix)}
        assert shipped == {f"quire_cpu-{MACHINE}-{lv}.{ext}" for lv in expected
                           for ext in ("so", "json")}
        manifest = json.loads(whl.read(f"{prefix}quire_cpu-{MACHINE}-{sorted(expected)[0]}"
                                       ".json"))
        wheel_tag = whl.read("quire-0.1.0.dist-info/WHEEL").decode()
    assert manifest["sources"] == kernel_build.source_digest()
    assert f"Tag: py3-none-linux_{MACHINE}" in wheel_tag  # machine code: one architecture


@pytest.mark.slow
def test_a_build_without_a_compiler_succeeds_and_ships_none(tmp_path: Path) -> None:
    wheel = _wheel(tmp_path, env={**os.environ, "CC": "no-such-compiler-quire"})
    with zipfile.ZipFile(wheel) as whl:
        assert not [n for n in whl.namelist() if "_prebuilt" in n]
        assert "Tag: py3-none-any" in whl.read("quire-0.1.0.dist-info/WHEEL").decode()


@needs_cc
def test_quire_plugins_names_the_library_and_its_origin(
        prebuilt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from quire.platforms.cpu.platform import CpuPlatform

    loaded = load_native_kernels(tmp_path, prebuilt=prebuilt)
    assert loaded is not None
    monkeypatch.setattr("quire.platforms.cpu.platform.load_native_kernels",
                        lambda **kwargs: loaded)
    kernels, waiting, attention, dtype, activations, *linears = CpuPlatform().details()
    assert kernels == f"C kernels: ISA level {loaded.level}, prebuilt: {loaded.path}"
    assert waiting.startswith("OpenMP waiting in engine processes: ")
    assert attention.startswith("attention: C for decode rows") and "chunks" in attention
    assert dtype.startswith("dtype auto: ")
    assert activations.startswith("activations auto ")
    assert ("bfloat16 for batches" in activations) == loaded.has_quant_bf16
    assert linears and all(line.startswith(("linear ", "... and ")) for line in linears)


CROSS_ARM = shutil.which("aarch64-linux-gnu-gcc")
EM_AARCH64 = 183  # the ELF header's e_machine for AArch64


def _exports(nm: str, library: Path) -> set[str]:
    listed = subprocess.run([nm, "-D", "--defined-only", str(library)], capture_output=True,
                            text=True, check=True).stdout
    return {line.split()[-1] for line in listed.splitlines()
            if line.split() and line.split()[-1].startswith("quire_")}


@needs_cc
@pytest.mark.skipif(CROSS_ARM is None or MACHINE != "x86_64" or shutil.which("nm") is None
                    or shutil.which("aarch64-linux-gnu-nm") is None,
                    reason="needs an x86-64 host with an AArch64 cross compiler and nm")
def test_every_arm_level_builds_and_exports_what_this_hosts_library_does(
        prebuilt: Path, tmp_path: Path) -> None:
    """The Arm levels cannot run here (no Arm CPU, no emulator), but their sources are
    compiled for AArch64 as the package build would on an Arm host: each level builds,
    is an AArch64 object, and exports every entry point the loader binds on this host."""
    arm_levels = levels_for("aarch64")
    built = kernel_build.build_prebuilt(tmp_path, "aarch64", arm_levels, CROSS_ARM)
    assert built == [level.name for level in arm_levels]
    host = prebuilt / kernel_build.prebuilt_name(MACHINE, levels_for(MACHINE)[0])
    wanted = _exports("nm", host)
    assert "quire_prompt_attention_bf16" in wanted and "quire_paged_decode_f32" in wanted
    for level in arm_levels:
        library = tmp_path / kernel_build.prebuilt_name("aarch64", level)
        assert int.from_bytes(library.read_bytes()[18:20], "little") == EM_AARCH64
        assert _exports("aarch64-linux-gnu-nm", library) == wanted, level.name
