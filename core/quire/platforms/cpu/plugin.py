"""Registers the cpu platform through the ``quire.platforms`` entry point.

The root ``pyproject.toml`` names this module exactly as a vendor package names its own,
so the built-in platform is discovered with no special case.
"""

from __future__ import annotations

from quire.platforms.cpu.platform import CpuPlatform
from quire.plugins.hookspecs import hookimpl
from quire.plugins.spec import PLUGIN_API_VERSION, PlatformSpec


@hookimpl
def quire_platforms() -> list[PlatformSpec]:
    """The one platform this plugin provides."""
    return [
        PlatformSpec(
            name=CpuPlatform.name,
            api_version=PLUGIN_API_VERSION,
            factory=CpuPlatform,
            description=("host CPU: C panel products and decoder layers, C prompt and paged "
                         "decode attention (torch SDPA fallback), gloo collectives"),
        )
    ]
