"""Why a build of the cpu platform's C kernels lacks a kernel: skip reasons for the tests
that need it.

The kernels are built once per ISA level (:mod:`quire.platforms.cpu.isa`), and the
``kernels`` fixture (tests/unit/conftest.py) runs a test at every level this CPU runs,
the lower ones included, so a host with AVX2 still tests the ``generic`` build, which
has no panel kernel. The reason names the level whose build lacks it, and why.
"""

from __future__ import annotations

from quire.platforms.cpu.isa import detect, levels_for
from quire.platforms.cpu.native import NativeKernels


def no_panels_reason(kernels: NativeKernels) -> str:
    """Why ``kernels``' build has no float32 panel GEMM (csrc/panel_gemm.c, compiled only
    where the level's flags enable AVX2 and FMA), for a build whose
    ``has_panel_gemm`` is false."""
    level = next(level for level in levels_for(detect().machine)
                 if level.name == kernels.level)
    flags = " ".join(level.flags) or "none: the compiler's default target"
    return (f"the {level.name} level's build has no panel kernel: csrc/panel_gemm.c needs "
            f"x86 AVX2 and FMA, which that level's flags ({flags}) do not enable")
