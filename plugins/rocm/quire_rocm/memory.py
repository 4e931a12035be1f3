"""Device-memory readings for one AMD GPU, from ``torch.cuda`` (ROCm torch maps it to HIP).

- total / free: the driver's figures (``torch.cuda.mem_get_info``, hipMemGetInfo), plus
  memory torch's caching allocator holds but is not using (torch hands it out first).
- peak: torch's caching-allocator high-water mark (``max_memory_allocated``). It sees only
  tensors allocated through torch; RCCL buffers, rocBLAS/hipBLASLt workspaces and other
  direct driver allocations are not in it.

This is a deliberate copy of the cuda plugin's profiler: plugins never import each other,
and code that names ``torch.cuda`` cannot live in the core. It is small enough that two
copies cost less than a shared dependency would.
"""

from __future__ import annotations

import torch

from quire.interfaces.memory import MemoryProfiler


class RocmMemoryProfiler(MemoryProfiler):
    """Reads local GPU ``device_index``. All figures are bytes.

    Readings of the peak synchronise the device first, so work still queued is counted.
    """

    def __init__(self, device_index: int = 0) -> None:
        self.device = torch.device("cuda", device_index)

    def total_memory(self) -> int:
        return int(torch.cuda.mem_get_info(self.device)[1])

    def free_memory(self) -> int:
        driver_free, total = torch.cuda.mem_get_info(self.device)
        cached_unused = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(
            self.device
        )
        return int(min(total, driver_free + max(0, cached_unused)))

    def reset_peak(self) -> None:
        self.synchronize()
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_memory(self) -> int:
        self.synchronize()
        return int(torch.cuda.max_memory_allocated(self.device))

    def synchronize(self) -> None:
        """Wait for the work queued on this device."""
        torch.cuda.synchronize(self.device)
