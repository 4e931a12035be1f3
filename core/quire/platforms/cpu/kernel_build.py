"""How the cpu platform's C kernels are compiled, and the libraries the package build ships.

One recipe serves both builds: the package build (``setup.py`` at the repository root,
which loads this file by path, so it must import nothing but the standard library) and
the first-use fallback of :func:`~quire.platforms.cpu.native.load_native_kernels`. The
library is every ``csrc/*.c`` compiled and linked into one, once per ISA level
(:mod:`~quire.platforms.cpu.isa`).

A prebuilt library ``_prebuilt/quire_cpu-<machine>-<level>.so`` has a manifest beside it
(``.json``: machine, level, flags, a digest of the sources). It fits a process when the
machine and the level's flags match and the digest equals that of the sources the
package holds now; an editable install whose C files changed since the build so sees
its prebuilt libraries as stale and builds at first use instead.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import tempfile
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from quire.platforms.cpu.isa import IsaLevel

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
#: Where the package build puts its libraries (not in git).
PREBUILT = Path(__file__).with_name("_prebuilt")
#: Common to every ISA level; each level adds its target flags (IsaLevel.flags).
FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=c11")
BUILD_TIMEOUT_S = 120


def sources(csrc: Path = CSRC) -> list[Path]:
    """The C files compiled into the one library, in a fixed order."""
    return sorted(csrc.glob("*.c"))


def headers(csrc: Path = CSRC) -> list[Path]:
    """The headers they include: part of the digest, not of the command."""
    return sorted(csrc.glob("*.h"))


def source_digest(csrc: Path = CSRC) -> str:
    """sha256 over the names and bytes of :func:`sources` and :func:`headers`."""
    key = hashlib.sha256()
    for path in (*sources(csrc), *headers(csrc)):
        key.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return key.hexdigest()


def compile_library(compiler: str, level: IsaLevel, target: Path,
                    csrc: Path = CSRC) -> None:
    """Compile the kernels for ``level`` into ``target``, atomically (built beside it and
    renamed, so a concurrent process sees all or nothing).

    Each source is compiled on its own, as many at once as this process has cores, the
    largest first, then the objects are linked: one compiler call for all of them took
    the sum of the files' times, and the test suite builds every level several times.

    :raises OSError: the compiler failed (its last stderr lines) or could not run.
    :raises subprocess.TimeoutExpired: a step took more than :data:`BUILD_TIMEOUT_S`.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        work = Path(tmp)
        objects = {src: work / f"{src.stem}.o" for src in sources(csrc)}
        compile_flags = [flag for flag in FLAGS if flag != "-shared"]

        def run(command: list[str]) -> None:
            result = subprocess.run(command, capture_output=True, text=True,
                                    timeout=BUILD_TIMEOUT_S, check=False)
            if result.returncode != 0:
                raise OSError(f"{compiler} failed: {result.stderr.strip()[-500:]}")

        largest_first = sorted(objects, key=lambda src: src.stat().st_size, reverse=True)
        with ThreadPoolExecutor(max_workers=_cores()) as pool:
            for done in [pool.submit(run, [compiler, *compile_flags, *level.flags, "-c",
                                           str(src), "-o", str(objects[src])])
                         for src in largest_first]:
                done.result()
        built = work / target.name
        run([compiler, *FLAGS, *level.flags, "-o", str(built), *map(str, objects.values()),
             "-lm"])
        os.replace(built, target)


def _cores() -> int:
    """Cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class Prebuilt:
    """What :func:`find_prebuilt` found for one level: a library to load, or why none."""

    #: the library, or None when none fits
    path: Path | None
    #: why none fits ("" when one does, or when the package ships none for the level)
    reason: str = ""


def prebuilt_name(machine: str, level: IsaLevel) -> str:
    return f"quire_cpu-{machine}-{level.name}.so"


def build_prebuilt(out_dir: Path, machine: str, levels: Iterable[IsaLevel],
                   compiler: str, csrc: Path = CSRC) -> list[str]:
    """The package build's step: one library (and its manifest) per level into
    ``out_dir``. A level the compiler cannot build is skipped with a warning.

    :returns: the names of the levels built.
    """
    digest = source_digest(csrc)
    built = []
    for level in levels:
        target = out_dir / prebuilt_name(machine, level)
        try:
            compile_library(compiler, level, target, csrc)
        except (OSError, subprocess.SubprocessError) as exc:
            logger.warning("quire cpu kernels: level %s not built (%s)", level.name, exc)
            continue
        manifest = {"machine": machine, "level": level.name,
                    "flags": [*FLAGS, *level.flags], "sources": digest}
        target.with_suffix(".json").write_text(json.dumps(manifest, indent=1) + "\n")
        built.append(level.name)
    return built


def find_prebuilt(directory: Path, machine: str, level: IsaLevel,
                  csrc: Path = CSRC) -> Prebuilt:
    """The library the package build left for ``level`` on ``machine``, when it fits the
    sources the package holds now."""
    library = directory / prebuilt_name(machine, level)
    if not library.exists():
        return Prebuilt(None)
    try:
        manifest = json.loads(library.with_suffix(".json").read_text())
    except (OSError, ValueError) as exc:
        return Prebuilt(None, f"{library.name} has no readable manifest ({exc})")
    if manifest.get("flags") != [*FLAGS, *level.flags] or manifest.get("machine") != machine:
        return Prebuilt(None, f"{library.name} was built with other flags or for another "
                              "machine")
    if manifest.get("sources") != source_digest(csrc):
        return Prebuilt(None, f"{library.name} is stale: the C sources changed since the "
                              "package was built (pip install -e . builds them again)")
    return Prebuilt(library)


def is_prebuilt(path: Path) -> bool:
    """Whether ``path`` is a library of the package build (it has a manifest beside it),
    rather than one built here."""
    return path.with_suffix(".json").exists()
