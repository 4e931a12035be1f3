"""The core distribution ships every file the package reads at run time.

An editable install reads the source tree, so a file left out of ``package-data`` is only
missed by a real install: the cpu platform's C sources compile from the installed
package, and without their header every native kernel is silently unavailable.
"""

from __future__ import annotations

import fnmatch
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "core" / "quire"
#: Files the package opens at run time, not imports.
DATA_SUFFIXES = {".c", ".h", ".txt", ".typed", ".html", ".js", ".css", ".LICENSE", ".proto"}


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib is Python 3.11+")
def test_package_data_covers_every_runtime_file():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = project["tool"]["setuptools"]["package-data"]["quire"]
    data = [p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*")
            if p.is_file() and p.suffix in DATA_SUFFIXES and "__pycache__" not in p.parts]
    assert any(name.endswith(".h") for name in data)  # the case that was once missed
    missing = [name for name in data if not any(fnmatch.fnmatch(name, pat) for pat in patterns)]
    assert not missing, f"not in pyproject.toml's package-data: {missing}"
