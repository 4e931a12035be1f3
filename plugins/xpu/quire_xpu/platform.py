"""The xpu platform: Intel GPUs through torch's native XPU backend.

Written against the vendor API docs, not run on hardware (see the package docstring).

Choices, and why:

- ``distributed_backend = "xccl"``: torch ships an XCCL process-group backend for XPU
  since 2.8, so no oneCCL bindings package (``oneccl_bindings_for_pytorch``, backend
  "ccl") is needed; the core requires a torch recent enough to have it.
- ``default_block_size = 64``: IPEX's ``flash_attn_varlen_func`` reads the cache in tiles
  of 64 tokens, and vLLM's XPU platform picks 64 for it; 16 works with IPEX's older
  paged-attention kernels, which this plugin does not use.
- dtypes: bfloat16 (preferred, the XMX engines' native type) and float16. float32 is not
  declared: IPEX's flash kernels do not take it.
- ``ZE_AFFINITY_MASK`` restricts the Level Zero devices a process sees.
"""

from __future__ import annotations

import importlib.util
import os

import torch
from quire.distributed import TorchDistributedCommunicator
from quire.interfaces.attention import AttentionBackend
from quire.interfaces.platform import Availability, Platform

from quire_xpu.memory import XpuMemoryProfiler


class XpuPlatform(Platform):
    name = "xpu"
    device_type = "xpu"
    visible_devices_env = "ZE_AFFINITY_MASK"
    distributed_backend = "xccl"
    supported_dtypes = (torch.bfloat16, torch.float16)
    default_block_size = 64
    priority = 100

    def availability(self) -> Availability:
        """torch built with XPU, a device visible, and an attention implementation
        installed (IPEX, or triton for the portable backend). Never raises."""
        xpu = getattr(torch, "xpu", None)
        if xpu is None or getattr(torch.version, "xpu", None) is None:
            return Availability.no(
                "torch was built without XPU support (torch.version.xpu is None); install "
                "torch from https://download.pytorch.org/whl/xpu")
        try:
            count = xpu.device_count()
        except Exception as exc:  # a broken driver surfaces here, not at import
            return Availability.no(f"driver error: torch.xpu.device_count() raised "
                                   f"{type(exc).__name__}: {exc}")
        if count == 0:
            mask = os.environ.get(self.visible_devices_env or "")
            hint = f" ({self.visible_devices_env}={mask!r})" if mask is not None else ""
            return Availability.no(f"no XPU device found{hint}; check the GPU driver and the "
                                   "Level Zero runtime (sycl-ls lists what is visible)")
        if not (_installed("intel_extension_for_pytorch") or _installed("triton")):
            return Availability.no(
                "neither intel_extension_for_pytorch nor triton is installed; the xpu "
                "attention backend needs one (IPEX from Intel's XPU wheel index, or the "
                "pytorch-triton-xpu that torch's XPU wheels bring)")
        return Availability.yes()

    def synchronize(self) -> None:
        torch.xpu.synchronize()

    def make_attention_backend(self) -> AttentionBackend:
        from quire_xpu.attention import make_backend

        return make_backend()

    def make_communicator(
        self, rank: int = 0, world_size: int = 1, group: object | None = None
    ) -> TorchDistributedCommunicator:
        """Collectives and send/recv over xccl; for ``world_size > 1`` the caller
        initialised the group."""
        return TorchDistributedCommunicator(self.distributed_backend, rank, world_size,
                                            group)

    def make_memory_profiler(self, device_index: int = 0) -> XpuMemoryProfiler:
        return XpuMemoryProfiler(device_index)


def _installed(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it (IPEX takes seconds)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that fails, or a broken entry
        return False
