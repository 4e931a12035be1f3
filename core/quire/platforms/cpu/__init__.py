"""The built-in cpu platform (host RAM, SDPA attention, packed linears, gloo).

Modules: ``platform`` (the Platform), ``attention`` (the reference backend, the oracle of
every other), ``sdpa_attention`` (the default backend), ``packed_linear`` (float32
linears on packed weights), ``threads`` (torch's thread count), ``memory`` (host RAM readings), ``plugin``
(the entry-point hook).
"""

from quire.platforms.cpu.platform import CpuPlatform

__all__ = ["CpuPlatform"]
