"""Registers the xpu platform. Imported at discovery, so it imports no vendor code."""

from __future__ import annotations

from quire.interfaces.platform import Platform
from quire.plugins.hookspecs import hookimpl
from quire.plugins.spec import PlatformSpec

# Written out, not imported: a plugin declares the API it was built for.
API_VERSION = "1.6"


def _factory() -> Platform:
    from quire_xpu.platform import XpuPlatform

    return XpuPlatform()


@hookimpl
def quire_platforms() -> list[PlatformSpec]:
    return [PlatformSpec("xpu", API_VERSION, _factory,
                         "Intel GPU: IPEX paged attention (Triton fallback), xccl (unverified)")]
