"""NPU memory readings through torch_npu (written against the docs, not run on hardware).

free/total come from the driver (``mem_get_info``: every process's use counts); the peak
is torch_npu's caching allocator's high-water mark of allocated bytes for this process.
"""

from __future__ import annotations

from typing import Any

from quire.interfaces.memory import MemoryProfiler


class NpuMemoryProfiler(MemoryProfiler):
    """Reads one NPU. All figures are bytes.

    :param npu: the ``torch_npu.npu`` module (passed in: this module imports no vendor code).
    """

    def __init__(self, npu: Any, device_index: int = 0) -> None:
        self._npu = npu
        self._index = device_index

    def total_memory(self) -> int:
        return int(self._npu.get_device_properties(self._index).total_memory)

    def free_memory(self) -> int:
        free, _total = self._npu.mem_get_info(self._index)
        return int(free)

    def reset_peak(self) -> None:
        self._npu.reset_peak_memory_stats(self._index)

    def peak_memory(self) -> int:
        return int(self._npu.max_memory_allocated(self._index))
