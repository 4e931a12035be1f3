"""Registers the rocm platform through the ``quire.platforms`` entry point.

Imported at discovery, so it imports neither torch.cuda nor triton: the factory imports
the platform module, and the platform probes the hardware only in ``availability()``.
"""

from __future__ import annotations

from quire.interfaces.platform import Platform
from quire.plugins.hookspecs import hookimpl
from quire.plugins.spec import PlatformSpec

# Written out, not imported: a plugin declares the API it was built for.
API_VERSION = "1.6"


def _rocm() -> Platform:
    from quire_rocm.platform import RocmPlatform

    return RocmPlatform()


@hookimpl
def quire_platforms() -> list[PlatformSpec]:
    return [
        PlatformSpec(
            name="rocm",
            api_version=API_VERSION,
            factory=_rocm,
            description="AMD GPUs (ROCm): Triton paged attention, RCCL collectives",
        )
    ]
