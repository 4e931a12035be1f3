"""Device-memory readings for one NVIDIA GPU, from ``torch.cuda``.

- total / free: the driver's figures (``torch.cuda.mem_get_info``), so other processes and
  every library's allocations count. Free also counts memory torch's caching allocator
  holds but is not using, since torch hands that out again before asking the driver.
- peak: torch's caching-allocator high-water mark (``max_memory_allocated``), reset by
  ``reset_peak_memory_stats``. It sees only tensors allocated through torch: memory that
  NCCL, cuBLAS/cuDNN workspaces or Triton's launcher take directly from the driver is not
  in it, so a profiled forward can under-report; the default budget's 10% headroom
  covers that.

The rocm plugin keeps its own copy of this small class on purpose: plugins never import
each other, and code that names ``torch.cuda`` cannot live in the core.
"""

from __future__ import annotations

import torch

from quire.interfaces.memory import MemoryProfiler


class CudaMemoryProfiler(MemoryProfiler):
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
