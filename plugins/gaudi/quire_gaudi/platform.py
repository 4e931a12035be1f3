"""The gaudi platform: Intel Gaudi accelerators through the Gaudi PyTorch bridge.

Written against the vendor API docs, not run on hardware (see the package docstring).

Choices, and why:

- ``device_type = "hpu"``: torch's own device type for Gaudi; the bridge
  (``habana_frameworks.torch``) provides its kernels and memory API.
- ``distributed_backend = "hccl"``: Habana's collective library, which torch.distributed
  knows once ``habana_frameworks.torch.distributed.hccl`` is imported; ``availability()``
  imports it, so a launcher that probes availability (as the registry does) before
  ``init_process_group`` finds the backend registered.
- ``default_block_size = 128``: the Gaudi matrix engines work on 128-wide tiles, and
  vLLM's Gaudi backend defaults to 128 for that reason.
- dtypes: bfloat16 (preferred, Gaudi's native type) and float32.
- ``HABANA_VISIBLE_MODULES`` restricts the Gaudi modules a process sees.

The engine never calls ``htcore.mark_step()``: run with ``PT_HPU_LAZY_MODE=0`` (eager
mode) so every op runs when issued.
"""

from __future__ import annotations

from types import ModuleType

import torch
from quire.distributed import TorchDistributedCommunicator
from quire.interfaces.platform import Availability, Platform

from quire_gaudi.attention import GaudiAttentionBackend
from quire_gaudi.memory import HpuMemoryProfiler

_BRIDGE = "habana_frameworks"


class GaudiPlatform(Platform):
    name = "gaudi"
    device_type = "hpu"
    visible_devices_env = "HABANA_VISIBLE_MODULES"
    distributed_backend = "hccl"
    supported_dtypes = (torch.bfloat16, torch.float32)
    default_block_size = 128
    priority = 100

    def availability(self) -> Availability:
        """The bridge importable (driver found) and a Gaudi visible. Never raises."""
        hpu, problem = import_hpu()
        if hpu is None:
            return Availability.no(problem)
        try:
            count = hpu.device_count()
        except Exception as exc:  # a broken driver surfaces here, not at import
            return Availability.no(f"driver error: habana_frameworks.torch.hpu."
                                   f"device_count() raised {type(exc).__name__}: {exc}")
        if count == 0:
            return Availability.no(f"no HPU device found; check 'hl-smi' and "
                                   f"{self.visible_devices_env}")
        return Availability.yes()

    def synchronize(self) -> None:
        _hpu().synchronize()

    def make_attention_backend(self) -> GaudiAttentionBackend:
        _hpu()
        from habana_frameworks.torch.hpex.kernels import FusedSDPA

        return GaudiAttentionBackend(FusedSDPA)

    def make_communicator(
        self, rank: int = 0, world_size: int = 1, group: object | None = None
    ) -> TorchDistributedCommunicator:
        """Collectives and send/recv over hccl; for ``world_size > 1`` the caller
        initialised the group."""
        _hpu()
        return TorchDistributedCommunicator(self.distributed_backend, rank, world_size,
                                            group)

    def make_memory_profiler(self, device_index: int = 0) -> HpuMemoryProfiler:
        return HpuMemoryProfiler(_hpu(), device_index)


def import_hpu() -> tuple[ModuleType | None, str]:
    """``(habana_frameworks.torch.hpu, "")``, or ``(None, why the bridge is unusable)``.

    Also imports the hccl module, which registers the backend with torch.distributed.
    """
    try:
        import habana_frameworks.torch.core
        import habana_frameworks.torch.distributed.hccl  # noqa: F401  (registers "hccl")
        from habana_frameworks.torch import hpu
    except ModuleNotFoundError as exc:
        if exc.name is not None and (exc.name == _BRIDGE or exc.name.startswith(_BRIDGE + ".")):
            return None, ("habana_frameworks is not installed (the Gaudi PyTorch bridge "
                          "ships with the Intel Gaudi software stack, not on PyPI)")
        return None, f"habana_frameworks failed to import: {exc}"
    except Exception as exc:  # typically the driver library or its firmware
        return None, (f"driver error: importing habana_frameworks raised "
                      f"{type(exc).__name__}: {exc}; check the Gaudi driver with 'hl-smi'")
    return hpu, ""


def _hpu() -> ModuleType:
    hpu, problem = import_hpu()
    if hpu is None:
        raise RuntimeError(f"the gaudi platform is not usable: {problem}")
    return hpu
