"""HPU memory readings through habana_frameworks.torch.hpu (written against the docs,
not run on hardware).

free/total come from the device (``mem_get_info``); the peak is the bridge's allocator's
high-water mark of allocated bytes for this process.
"""

from __future__ import annotations

from typing import Any

from quire.interfaces.memory import MemoryProfiler


class HpuMemoryProfiler(MemoryProfiler):
    """Reads one Gaudi device. All figures are bytes.

    :param hpu: the ``habana_frameworks.torch.hpu`` module (passed in: this module imports
        no vendor code).
    """

    def __init__(self, hpu: Any, device_index: int = 0) -> None:
        self._hpu = hpu
        self._device = f"hpu:{device_index}"

    def total_memory(self) -> int:
        _free, total = self._hpu.mem_get_info(self._device)
        return int(total)

    def free_memory(self) -> int:
        free, _total = self._hpu.mem_get_info(self._device)
        return int(free)

    def reset_peak(self) -> None:
        self._hpu.reset_peak_memory_stats(self._device)

    def peak_memory(self) -> int:
        return int(self._hpu.max_memory_allocated(self._device))
