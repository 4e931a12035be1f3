"""The built-in cpu platform: host RAM, the reference attention, gloo collectives."""

from __future__ import annotations

import torch

from quire.distributed import TorchDistributedCommunicator
from quire.interfaces.platform import Availability, Platform
from quire.platforms.cpu.attention import CpuAttentionBackend
from quire.platforms.cpu.memory import CpuMemoryProfiler


class CpuPlatform(Platform):
    """Runs anywhere torch runs; the fallback for ``device="auto"`` (priority 0).

    Thread count is left to torch's defaults, which the user controls
    (``OMP_NUM_THREADS``, ``torch.set_num_threads``).
    """

    name = "cpu"
    device_type = "cpu"
    distributed_backend = "gloo"
    # float32 first: the only dtype every CPU computes natively; the half types are for
    # fitting larger models in RAM, at some speed cost on hosts without native support.
    supported_dtypes = (torch.float32, torch.bfloat16, torch.float16)
    default_block_size = 16
    priority = 0

    def availability(self) -> Availability:
        return Availability.yes()

    def make_attention_backend(self) -> CpuAttentionBackend:
        return CpuAttentionBackend()

    def make_communicator(
        self, rank: int = 0, world_size: int = 1
    ) -> TorchDistributedCommunicator:
        """Collectives over gloo; for ``world_size > 1`` the caller initialised the group."""
        return TorchDistributedCommunicator(self.distributed_backend, rank, world_size)

    def make_memory_profiler(self, device_index: int = 0) -> CpuMemoryProfiler:
        """Host RAM is one pool, so every ``device_index`` (one per local rank) reads it."""
        return CpuMemoryProfiler()
