"""The core distribution's build: pyproject.toml's setuptools, plus one step.

``build_cpu_kernels`` compiles the cpu platform's C kernels once per ISA level of this
machine's architecture into ``quire/platforms/cpu/_prebuilt/`` (in the wheel, or in the
source tree for an editable install), so users need no compiler. It never fails the
install: without a compiler, or where a level does not build, the package ships fewer
libraries (or none) and the run time builds at first use or warns
(:mod:`quire.platforms.cpu.native`). ``QUIRE_BUILD_CPU_KERNELS=0`` skips it.

``build_grpc_stubs`` generates the gRPC service's Python modules from
``quire/entrypoints/grpc/generation.proto`` with grpcio-tools (a build requirement), the
same way: into the wheel, or into the source tree for an editable install. They are never
committed; without grpcio-tools the build warns and the run time generates them at first
use where it can, else says how (:mod:`quire.entrypoints.grpc.stubs`).
"""

from __future__ import annotations

import importlib.util
import os
import platform
import shutil
import sys
from pathlib import Path
from types import ModuleType

from setuptools import Command, setup
from setuptools.command.build import build

ROOT = Path(__file__).resolve().parent
CPU = ROOT / "core" / "quire" / "platforms" / "cpu"
IN_PACKAGE = Path("quire", "platforms", "cpu", "_prebuilt")
GRPC_STUBS = ROOT / "core" / "quire" / "entrypoints" / "grpc" / "stubs.py"


def _load(name: str, path: Path | None = None) -> ModuleType:
    """A stdlib-only module of the cpu platform (or at ``path``), by path: importing
    ``quire`` here would need torch, which an isolated build environment does not have."""
    spec = importlib.util.spec_from_file_location(f"_quire_build_{name}",
                                                  path or CPU / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc"))


class build_cpu_kernels(Command):
    description = "compile the cpu platform's C kernels for each ISA level of this machine"
    user_options: list[tuple[str, str | None, str]] = []

    def initialize_options(self) -> None:
        self.build_lib: str | None = None
        self.editable_mode = False
        self._outputs: list[str] = []

    def finalize_options(self) -> None:
        self.set_undefined_options("build_py", ("build_lib", "build_lib"))

    def run(self) -> None:
        out = CPU / "_prebuilt" if self.editable_mode else Path(self.build_lib) / IN_PACKAGE
        try:
            self._outputs = _build_kernels(out)
        except Exception as exc:  # noqa: BLE001 - never fail the install; run time falls back
            _say(f"cpu kernels not prebuilt ({type(exc).__name__}: {exc}); they build at "
                 "first use where a compiler exists")

    def get_outputs(self) -> list[str]:
        return [] if self.editable_mode else self._outputs

    def get_output_mapping(self) -> dict[str, str]:
        return {}

    def get_source_files(self) -> list[str]:
        return []


def _build_kernels(out: Path) -> list[str]:
    if os.environ.get("QUIRE_BUILD_CPU_KERNELS", "1") == "0":
        _say("cpu kernels not prebuilt (QUIRE_BUILD_CPU_KERNELS=0)")
        return []
    compiler = _compiler()
    if compiler is None:
        _say(f"cpu kernels not prebuilt: no C compiler ({os.environ.get('CC', 'cc')}); "
             "they build at first use where one exists")
        return []
    isa, kernel_build = _load("isa"), _load("kernel_build")
    machine = isa.normalise_machine(platform.machine())
    for old in (*out.glob("quire_cpu-*.so"), *out.glob("quire_cpu-*.json")):
        old.unlink()  # a level this build cannot make must not survive from an older one
    built = kernel_build.build_prebuilt(out, machine, isa.levels_for(machine), compiler)
    _say(f"cpu kernels prebuilt for {machine}: {', '.join(built) or 'no level'} in {out}")
    return [str(p) for p in sorted(out.glob("quire_cpu-*"))]


class build_grpc_stubs(Command):
    description = "generate the gRPC service's Python modules from its .proto"
    user_options: list[tuple[str, str | None, str]] = []

    def initialize_options(self) -> None:
        self.build_lib: str | None = None
        self.editable_mode = False
        self._outputs: list[str] = []

    def finalize_options(self) -> None:
        self.set_undefined_options("build_py", ("build_lib", "build_lib"))

    def run(self) -> None:
        stubs = _load("grpc_stubs", GRPC_STUBS)
        out = ROOT / "core" if self.editable_mode or self.build_lib is None \
            else Path(self.build_lib)
        try:
            self._outputs = [str(p) for p in stubs.compile_stubs(out)]
        except RuntimeError as exc:
            if "grpcio-tools" not in str(exc):
                raise  # a proto that does not compile must not ship
            _say(f"gRPC stubs not generated ({exc}); they are generated at first use "
                 "where grpcio-tools is installed")
            return
        _say(f"gRPC stubs generated in {out}")

    def get_outputs(self) -> list[str]:
        return [] if self.editable_mode else self._outputs

    def get_output_mapping(self) -> dict[str, str]:
        return {}

    def get_source_files(self) -> list[str]:
        return [str(GRPC_STUBS.with_name("generation.proto").relative_to(ROOT))]


def _say(message: str) -> None:
    print(f"quire build: {message}", file=sys.stderr)


class build_with_kernels(build):
    sub_commands = [*build.sub_commands, ("build_cpu_kernels", None),
                    ("build_grpc_stubs", None)]


commands: dict[str, type] = {"build": build_with_kernels, "build_cpu_kernels": build_cpu_kernels,
                             "build_grpc_stubs": build_grpc_stubs}
try:
    from setuptools.command.bdist_wheel import bdist_wheel

    class platform_wheel(bdist_wheel):
        """Tagged ``py3-none-<platform>`` when it holds machine code (a compiler is at
        hand): any Python 3 and no extension ABI, but one architecture."""

        def finalize_options(self) -> None:
            super().finalize_options()
            if _compiler() is not None and os.environ.get("QUIRE_BUILD_CPU_KERNELS") != "0":
                self.plat_name_supplied = True  # get_tag then uses bdist's platform

    commands["bdist_wheel"] = platform_wheel
except ImportError:  # setuptools < 70.1: the wheel package's bdist_wheel, tagged pure
    pass

setup(cmdclass=commands)
