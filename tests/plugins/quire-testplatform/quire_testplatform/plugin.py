"""Registers testdev (available, preferred over cpu) and testdev-absent (never available)."""

from __future__ import annotations

from quire.interfaces.platform import Platform
from quire.plugins.hookspecs import hookimpl
from quire.plugins.spec import PlatformSpec

# Written out, not imported: a plugin declares the API it was built for.
API_VERSION = "1.0"


# The factories import the platform module on first use, as a vendor plugin imports its
# vendor library: listing the plugin must stay cheap.
def _testdev() -> Platform:
    from quire_testplatform.platform import TestdevPlatform

    return TestdevPlatform()


def _testdev_absent() -> Platform:
    from quire_testplatform.platform import AbsentTestdevPlatform

    return AbsentTestdevPlatform()


@hookimpl
def quire_platforms() -> list[PlatformSpec]:
    return [
        PlatformSpec("testdev", API_VERSION, _testdev, "test-only: the cpu platform renamed"),
        PlatformSpec("testdev-absent", API_VERSION, _testdev_absent, "test-only: never attached"),
    ]
