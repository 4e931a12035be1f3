"""Registers platform badapi, built for plugin API 99.0."""

from __future__ import annotations

from quire.interfaces.platform import Platform
from quire.plugins.hookspecs import hookimpl
from quire.plugins.spec import PlatformSpec


def _never_built() -> Platform:
    # A refused platform's code may rely on an API this core lacks, so it must not run.
    raise AssertionError("the registry built a platform it had refused")


@hookimpl
def quire_platforms() -> list[PlatformSpec]:
    return [PlatformSpec("badapi", "99.0", _never_built, "test-only: from the future")]
