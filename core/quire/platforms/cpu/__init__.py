"""The built-in cpu platform (host RAM, reference attention, gloo).

Modules: ``platform`` (the Platform), ``attention`` (the reference backend), ``memory``
(host RAM readings), ``plugin`` (the entry-point hook).
"""

from quire.platforms.cpu.platform import CpuPlatform

__all__ = ["CpuPlatform"]
