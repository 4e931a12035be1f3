"""Registers the gaudi platform. Imported at discovery, so it imports no vendor code."""

from __future__ import annotations

from quire.interfaces.platform import Platform
from quire.plugins.hookspecs import hookimpl
from quire.plugins.spec import PlatformSpec

# Written out, not imported: a plugin declares the API it was built for.
API_VERSION = "1.6"


def _factory() -> Platform:
    from quire_gaudi.platform import GaudiPlatform

    return GaudiPlatform()


@hookimpl
def quire_platforms() -> list[PlatformSpec]:
    return [PlatformSpec("gaudi", API_VERSION, _factory,
                         "Intel Gaudi (HPU): FusedSDPA prefill, flat paged decode, hccl "
                         "(unverified)")]
