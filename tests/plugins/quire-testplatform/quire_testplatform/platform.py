"""The cpu platform's backends under other names, so tests can tell who was chosen."""

from __future__ import annotations

from quire.interfaces.platform import Availability
from quire.platforms.cpu.platform import CpuPlatform


class TestdevPlatform(CpuPlatform):
    """Host tensors and the cpu backends; priority 5 so ``auto`` prefers it over cpu (0)."""

    name = "testdev"
    priority = 5


class AbsentTestdevPlatform(CpuPlatform):
    """Never available. Its priority beats testdev's, so ``auto`` must skip it by reason."""

    name = "testdev-absent"
    priority = 10

    def availability(self) -> Availability:
        return Availability.no("no test device attached")
