"""XPU memory readings from torch.xpu (written against the docs, not run on hardware).

free/total come from the driver (``mem_get_info``: every process's use counts); the peak
is torch's caching allocator's high-water mark of allocated bytes for this process.
"""

from __future__ import annotations

import torch
from quire.interfaces.memory import MemoryProfiler


class XpuMemoryProfiler(MemoryProfiler):
    """Reads one XPU device. All figures are bytes."""

    def __init__(self, device_index: int = 0) -> None:
        self._index = device_index

    def total_memory(self) -> int:
        return int(torch.xpu.get_device_properties(self._index).total_memory)

    def free_memory(self) -> int:
        free, _total = torch.xpu.mem_get_info(self._index)
        return int(free)

    def reset_peak(self) -> None:
        torch.xpu.reset_peak_memory_stats(self._index)

    def peak_memory(self) -> int:
        return int(torch.xpu.max_memory_allocated(self._index))
