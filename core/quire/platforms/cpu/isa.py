"""Which instruction sets the running CPU has, and which build of the C kernels it runs.

The C kernels (:mod:`~quire.platforms.cpu.native`) are built once per *ISA level*: a
name, the compiler flags that target it, and the CPU features those flags let the
compiler use. The level is chosen from what this CPU reports at run time, not from the
build host's ``-march=native``, so a kernel cache shared by several machines (or a
container image built on another) never runs an instruction the CPU lacks, and a lower
level can be forced to compare paths on one host.

Each level's flags enable exactly the features it lists (``-march=x86-64`` plus
``-m<feature>``, rather than ``-march=x86-64-v3``, which would also let the compiler
emit BMI2 or MOVBE, features some hypervisors hide while passing AVX2 through).
"""

from __future__ import annotations

import logging
import platform
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path

logger = logging.getLogger(__name__)

CPUINFO = Path("/proc/cpuinfo")


@dataclass(frozen=True)
class CpuFeatures:
    """The instruction-set extensions Quire cares about, as the running CPU reports them.

    Field names are Linux's ``/proc/cpuinfo`` names, so parsing is a lookup.
    """

    #: the machine architecture, normalised: ``x86_64``, ``aarch64`` or as Python says
    machine: str = ""
    # x86
    avx2: bool = False
    fma: bool = False
    avx512f: bool = False
    avx512bw: bool = False
    avx512vl: bool = False
    avx512dq: bool = False
    avx512_bf16: bool = False
    avx512_vnni: bool = False
    avx_vnni: bool = False
    amx_bf16: bool = False
    amx_int8: bool = False
    amx_tile: bool = False
    # Arm (AArch64)
    #: NEON (Advanced SIMD)
    asimd: bool = False
    #: half-precision NEON arithmetic (Armv8.2 FP16)
    asimdhp: bool = False
    #: NEON dot product (SDOT/UDOT)
    asimddp: bool = False
    sve: bool = False
    bf16: bool = False
    i8mm: bool = False

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """Every feature flag this class knows (its boolean fields)."""
        return tuple(f.name for f in fields(cls) if f.name != "machine")

    @classmethod
    def of(cls, machine: str, present: Iterable[str]) -> CpuFeatures:
        """The features among ``present`` (other names ignored) on ``machine``."""
        wanted = set(cls.names())
        return cls(machine=normalise_machine(machine),
                   **{name: True for name in present if name in wanted})

    @property
    def present(self) -> frozenset[str]:
        """The names of the features this CPU has."""
        return frozenset(name for name in self.names() if getattr(self, name))


def has_bf16_products(features: CpuFeatures) -> bool:
    """Whether the CPU multiplies bfloat16 natively with float32 accumulation (x86:
    AVX512_BF16 or AMX-BF16; Arm: the BF16 extension), which oneDNN's bfloat16
    products use: bfloat16 then halves the bytes a product reads without converting
    in software."""
    if features.machine == "aarch64":
        return features.bf16
    return features.avx512_bf16 or features.amx_bf16


@dataclass(frozen=True)
class IsaLevel:
    """A build target of the C kernels: what it is called, how it is compiled, and what
    the CPU needs to run it."""

    name: str
    #: compiler flags added to the common ones (optimisation, OpenMP, shared library)
    flags: tuple[str, ...]
    #: :class:`CpuFeatures` field names the code built with ``flags`` may use
    needs: frozenset[str] = frozenset()

    def missing(self, features: CpuFeatures) -> frozenset[str]:
        """The features this level needs that ``features`` lacks."""
        return self.needs - features.present


_X86_AVX2 = ("-march=x86-64", "-mavx2", "-mfma")
_AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512dq")
_AVX512_BF16 = (*_AVX512, "avx512bf16", "avx512vnni")
#: Each architecture's levels, lowest first.
_LEVELS: dict[str, tuple[IsaLevel, ...]] = {
    "x86_64": (
        IsaLevel("generic", ("-march=x86-64",)),
        IsaLevel("avx2", _X86_AVX2, frozenset({"avx2", "fma"})),
        IsaLevel("avx512", (*_X86_AVX2, *(f"-m{f}" for f in _AVX512)),
                 frozenset({"avx2", "fma", *_AVX512})),
        # bfloat16 dot products (vdpbf16ps): the pair-panel kernel, csrc/panel_bf16.c; and
        # int8 ones (vpdpbusd, AVX512_VNNI, which every CPU with AVX512_BF16 has):
        # csrc/quant_gemm.c's w8a8 products
        IsaLevel("avx512_bf16", (*_X86_AVX2, *(f"-m{f}" for f in _AVX512_BF16)),
                 frozenset({"avx2", "fma", *_AVX512, "avx512_bf16", "avx512_vnni"})),
        # AMX tiles, used only once Linux grants the tile state at run time: TDPBF16PS
        # for bfloat16 products on quantised weights' pair panels (csrc/amx_tiles.c),
        # TDPBSUD for int8 activations times their codes (csrc/quant_q8.c's batches);
        # every CPU with AMX-BF16 has AMX-INT8
        IsaLevel("amx", (*_X86_AVX2, *(f"-m{f}" for f in (*_AVX512_BF16, "amx-tile",
                                                          "amx-bf16", "amx-int8"))),
                 frozenset({"avx2", "fma", *_AVX512, "avx512_bf16", "avx512_vnni",
                            "amx_tile", "amx_bf16", "amx_int8"})),
    ),
    "aarch64": (
        IsaLevel("generic", ("-march=armv8-a",)),  # NEON is part of every AArch64 CPU
        IsaLevel("neon", ("-march=armv8.2-a+fp16+dotprod",),
                 frozenset({"asimd", "asimdhp", "asimddp"})),
    ),
}
#: Where no levels are known: the compiler's default target, whatever it is.
_FALLBACK = (IsaLevel("generic", ()),)
#: Every level name, on any architecture: what the ``isa`` option accepts.
LEVEL_NAMES: tuple[str, ...] = tuple(dict.fromkeys(
    level.name for levels in _LEVELS.values() for level in levels))

_MACHINE_ALIASES = {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}


def normalise_machine(machine: str) -> str:
    """``platform.machine()``'s spellings of one architecture as one name."""
    lowered = machine.lower()
    return _MACHINE_ALIASES.get(lowered, lowered)


def levels_for(machine: str) -> tuple[IsaLevel, ...]:
    """The levels the kernels can be built for on ``machine``, lowest first (only
    ``generic``, the compiler's default target, where Quire knows none)."""
    return _LEVELS.get(normalise_machine(machine), _FALLBACK)


def best_level(features: CpuFeatures, available_levels: Sequence[IsaLevel],
               forced: str | None = None) -> IsaLevel:
    """The highest of ``available_levels`` (ordered lowest first) this CPU runs, or the
    ``forced`` one.

    :param forced: a level name (the ``isa`` option), e.g. to run AVX2 code on an
        AVX-512 host; None picks the best.
    :raises ValueError: when ``forced`` is not among ``available_levels`` (naming
        those), or ``features`` lacks what it needs (naming the missing features); when
        no level fits at all.
    """
    if forced is not None:
        by_name = {level.name: level for level in available_levels}
        if forced not in by_name:
            raise ValueError(
                f"cpu ISA level {forced!r} is not built on {features.machine or 'this'} "
                f"machines; levels here: {', '.join(by_name) or 'none'}")
        missing = by_name[forced].missing(features)
        if missing:
            raise ValueError(f"cpu ISA level {forced!r} needs CPU features this CPU lacks: "
                             f"{', '.join(sorted(missing))}")
        return by_name[forced]
    for level in reversed(available_levels):
        if not level.missing(features):
            return level
    raise ValueError(f"no cpu ISA level among {', '.join(lv.name for lv in available_levels)}"
                     f" fits features {', '.join(sorted(features.present)) or 'none'}")


def parse_cpuinfo(text: str, machine: str) -> CpuFeatures:
    """Features from a Linux ``/proc/cpuinfo`` text: its first ``flags`` (x86) or
    ``Features`` (Arm) line; none when it has neither."""
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            return CpuFeatures.of(machine, value.split())
    return CpuFeatures(machine=normalise_machine(machine))


def detect(cpuinfo: Path = CPUINFO, machine: str | None = None) -> CpuFeatures:
    """The running CPU's features (Linux); elsewhere, or when the file cannot be read or
    lists none, an empty set (so the ``generic`` level), with the reason logged.
    """
    machine = normalise_machine(machine or platform.machine())
    try:
        text = cpuinfo.read_text()
    except OSError as exc:
        logger.info("cpu features unknown (%s: %s); assuming none, the generic kernels "
                    "run", cpuinfo, exc.strerror or exc)
        return CpuFeatures(machine=machine)
    features = parse_cpuinfo(text, machine)
    if not any(line.startswith(("flags", "Features")) for line in text.splitlines()):
        logger.info("cpu features unknown (%s lists none); assuming none, the generic "
                    "kernels run", cpuinfo)
    return features
