"""Fixtures shared by the cpu platform's native-kernel tests."""

from __future__ import annotations

import shutil

import pytest

from quire.platforms.cpu.native import NativeKernels, load_native_kernels


@pytest.fixture(scope="session")
def kernels(tmp_path_factory: pytest.TempPathFactory) -> NativeKernels:
    """The C kernels, built once per session into a fresh directory (not the user's
    cache). Skips where there is no C compiler; fails where one exists but the build
    does not work."""
    if shutil.which("cc") is None:
        pytest.skip("no C compiler on this host: the platform uses torch ops")
    loaded = load_native_kernels(tmp_path_factory.mktemp("kernels"))
    assert loaded is not None, "cc exists but the kernels did not build; see the log"
    return loaded
