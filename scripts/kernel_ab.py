"""What the kernel A/B scripts (``bench_panel_gemm.py``, ``bench_paged_decode.py``) share:
two libraries of one ISA level built from this checkout's ``csrc/``, one with some of
its files as a baseline revision had them, and a best-of timer.
"""

from __future__ import annotations

import argparse
import ctypes
import shutil
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from quire.platforms.cpu import kernel_build
from quire.platforms.cpu.isa import IsaLevel, best_level, detect, levels_for

#: The kernels' sources, from the repository's root.
CSRC = "core/quire/platforms/cpu/csrc"


def add_arguments(parser: argparse.ArgumentParser, what: str, rounds: int) -> None:
    """The options every A/B script takes; ``what`` names the baseline's files."""
    parser.add_argument("--baseline-rev", default="HEAD",
                        help=f"git revision whose {what} is the baseline")
    parser.add_argument("--isa", default=None, help="ISA level (default: the best here)")
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--budget", type=float, default=0.05, help="seconds per cell")


def level_of(args: argparse.Namespace) -> IsaLevel:
    """The ISA level to build: ``--isa``, else the best this CPU runs."""
    features = detect()
    return best_level(features, levels_for(features.machine), forced=args.isa)


def libraries(rev: str, names: Iterable[str], level: IsaLevel,
              work: Path) -> dict[str, ctypes.CDLL]:
    """{'base': library, 'new': library}: ``csrc/`` as checked out, and with the files
    ``names`` as ``rev`` had them (and without the files ``rev`` did not have)."""
    new_src, base_src = work / "new", work / "base"
    shutil.copytree(kernel_build.CSRC, new_src)
    shutil.copytree(kernel_build.CSRC, base_src)
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True,
                          text=True, check=True, cwd=kernel_build.CSRC).stdout.strip()
    for name in names:
        old = subprocess.run(["git", "show", f"{rev}:{CSRC}/{name}"], capture_output=True,
                             check=True, cwd=root).stdout
        (base_src / name).write_bytes(old)
    for path in base_src.iterdir():  # files newer than rev may need the new headers
        known = subprocess.run(["git", "cat-file", "-e", f"{rev}:{CSRC}/{path.name}"],
                               capture_output=True, cwd=root)
        if known.returncode != 0:
            path.unlink()
    built = {}
    for which, src in (("base", base_src), ("new", new_src)):
        target = work / f"{which}.so"
        kernel_build.compile_library(shutil.which("cc") or "cc", level, target, src)
        built[which] = ctypes.CDLL(str(target))
    return built


def best_seconds(call: Callable[[], object], budget_s: float) -> float:
    """Best seconds per call over calls spanning about ``budget_s``, after one to warm
    (scratch, pages, caches)."""
    call()
    best, spent = float("inf"), 0.0
    while spent < budget_s:
        start = time.perf_counter()
        call()
        took = time.perf_counter() - start
        best, spent = min(best, took), spent + took
    return best
