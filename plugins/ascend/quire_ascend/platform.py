"""The ascend platform: Huawei Ascend NPUs through torch_npu and CANN.

Written against the vendor API docs, not run on hardware (see the package docstring).

Choices, and why:

- ``device_type = "npu"``: the device torch_npu registers (as torch's PrivateUse1), so
  ``torch.device("npu", i)`` exists only once torch_npu is imported; ``availability()``
  imports it, and the registry probes availability before a platform is used.
- ``distributed_backend = "hccl"``: Huawei's collective library, registered with
  torch.distributed by importing torch_npu.
- ``default_block_size = 128``: the block size CANN's paged-attention operators are tuned
  for, and vLLM-Ascend's default; the fused inference attention operator takes blocks
  that are multiples of 16 up to 512 (the conformance suite also tries 16).
- dtypes: bfloat16 (preferred) and float16, the ones the fused attention operators take.
- ``ASCEND_RT_VISIBLE_DEVICES`` restricts the NPUs a process sees.
"""

from __future__ import annotations

from types import ModuleType

import torch
from quire.distributed import TorchDistributedCommunicator
from quire.interfaces.platform import Availability, Platform

from quire_ascend.attention import AscendAttentionBackend
from quire_ascend.memory import NpuMemoryProfiler


class AscendPlatform(Platform):
    name = "ascend"
    device_type = "npu"
    visible_devices_env = "ASCEND_RT_VISIBLE_DEVICES"
    distributed_backend = "hccl"
    supported_dtypes = (torch.bfloat16, torch.float16)
    default_block_size = 128
    priority = 100

    def availability(self) -> Availability:
        """torch_npu importable (CANN found) and an NPU visible. Never raises."""
        torch_npu, problem = import_torch_npu()
        if torch_npu is None:
            return Availability.no(problem)
        try:
            count = torch_npu.npu.device_count()
        except Exception as exc:  # a broken driver surfaces here, not at import
            return Availability.no(f"driver error: torch_npu.npu.device_count() raised "
                                   f"{type(exc).__name__}: {exc}")
        if count == 0:
            return Availability.no(f"no NPU device found; check 'npu-smi info' and "
                                   f"{self.visible_devices_env}")
        return Availability.yes()

    def synchronize(self) -> None:
        _torch_npu().npu.synchronize()

    def make_attention_backend(self) -> AscendAttentionBackend:
        return AscendAttentionBackend(_torch_npu())

    def make_communicator(
        self, rank: int = 0, world_size: int = 1, group: object | None = None
    ) -> TorchDistributedCommunicator:
        """Collectives and send/recv over hccl; for ``world_size > 1`` the caller
        initialised the group
        (after importing torch_npu, which registers the backend)."""
        _torch_npu()
        return TorchDistributedCommunicator(self.distributed_backend, rank, world_size,
                                            group)

    def make_memory_profiler(self, device_index: int = 0) -> NpuMemoryProfiler:
        return NpuMemoryProfiler(_torch_npu().npu, device_index)


def import_torch_npu() -> tuple[ModuleType | None, str]:
    """``(torch_npu, "")``, or ``(None, why it cannot be imported)``."""
    try:
        import torch_npu
    except ModuleNotFoundError as exc:
        if exc.name == "torch_npu":
            return None, ("torch_npu is not installed (pip install torch-npu, the release "
                          "that matches your torch and CANN versions)")
        return None, f"torch_npu failed to import: {exc}"
    except Exception as exc:  # typically a CANN shared library that cannot be loaded
        return None, (f"driver error: importing torch_npu raised {type(exc).__name__}: "
                      f"{exc}; check that CANN is installed and its set_env.sh is sourced")
    return torch_npu, ""


def _torch_npu() -> ModuleType:
    torch_npu, problem = import_torch_npu()
    if torch_npu is None:
        raise RuntimeError(f"the ascend platform is not usable: {problem}")
    return torch_npu
