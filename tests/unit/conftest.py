"""Fixtures shared by the cpu platform's native-kernel tests."""

from __future__ import annotations

import shutil

import pytest

from quire.platforms.cpu.isa import detect, levels_for
from quire.platforms.cpu.native import NativeKernels, load_native_kernels


def _host_levels() -> list[str]:
    """Every ISA level this CPU runs, so the lower paths are tested on any host."""
    features = detect()
    return [level.name for level in levels_for(features.machine)
            if not level.missing(features)]


@pytest.fixture(scope="session", params=_host_levels())
def kernels(request: pytest.FixtureRequest) -> NativeKernels:
    """The C kernels of each ISA level this CPU runs: the prebuilt library where it fits
    the sources, else one built into the suite's kept cache (tests/conftest.py's
    ``quire_cache``), once per change of the sources. Skips where there is no C
    compiler; fails where one exists but the build does not work."""
    if shutil.which("cc") is None:
        pytest.skip("no C compiler on this host: the platform uses torch ops")
    loaded = load_native_kernels(isa=request.param)
    assert loaded is not None, "cc exists but the kernels did not build; see the log"
    assert loaded.level == request.param
    return loaded


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the ``amx`` level's kernels only in modules marked ``amx``: its build differs
    from ``avx512_bf16``'s only in the bfloat16 products on quantised weights
    (csrc/amx_tiles.c, csrc/quant_gemm.c) and the int8 activations' batches
    (csrc/quant_q8.c), so every other kernel test would run the same code a second
    time."""
    skip = pytest.mark.skip(reason="the amx build runs avx512_bf16's code here; modules "
                                   "marked amx run it (tests/unit/conftest.py)")
    for item in items:
        callspec = getattr(item, "callspec", None)
        if (callspec is not None and callspec.params.get("kernels") == "amx"
                and item.get_closest_marker("amx") is None):
            item.add_marker(skip)
