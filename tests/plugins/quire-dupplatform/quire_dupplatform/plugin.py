"""Registers a second platform named testdev; the registry must refuse the pair."""

from __future__ import annotations

from quire.interfaces.platform import Platform
from quire.plugins.hookspecs import hookimpl
from quire.plugins.spec import PlatformSpec


def _never_built() -> Platform:
    raise AssertionError("a platform with a conflicting name was built")


@hookimpl
def quire_platforms() -> list[PlatformSpec]:
    return [PlatformSpec("testdev", "1.0", _never_built, "test-only: a name collision")]
