"""The memory-profiler contract: how much device memory there is, and how much KV fits."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable


class MemoryProfiler(ABC):
    """Reads one device's memory. All figures are bytes.

    Subclasses implement the four readings; the block-count arithmetic lives here, once,
    so every platform sizes its KV cache by the same rule.
    """

    @abstractmethod
    def total_memory(self) -> int:
        """Capacity of the device (or of system RAM for host platforms)."""

    @abstractmethod
    def free_memory(self) -> int:
        """Memory still available to this process now; ``<= total_memory()``."""

    @abstractmethod
    def reset_peak(self) -> None:
        """Start a new peak-measurement window."""

    @abstractmethod
    def peak_memory(self) -> int:
        """Highest memory in use by this process since the last :meth:`reset_peak`."""

    def profile(self, fn: Callable[[], object]) -> int:
        """Run ``fn`` once and return how far the peak rose above the use before it (>= 0)."""
        self.reset_peak()
        before = self.peak_memory()
        fn()
        return max(0, self.peak_memory() - before)

    def profile_tokens(self, num_tokens: int) -> int:
        """Tokens of the forward that :meth:`profile` measures for a ``num_tokens`` step.

        The engine scales the measured peak by ``num_tokens / result``, so a platform
        may return fewer only when its activations grow at most linearly with the
        step's tokens. Default: ``num_tokens`` (measure the real size).
        """
        return num_tokens

    def kv_budget(self, kv_cache_memory: int | float | None, activation_peak: int = 0) -> int:
        """Bytes granted to the KV cache.

        :param kv_cache_memory: an absolute number of bytes (``int``), a fraction of the
            memory free now (``float`` in (0, 1]), or ``None`` for :meth:`default_budget`.
        :param activation_peak: bytes a forward pass needs on top (from :meth:`profile`);
            subtracted from a fractional or default budget, since that memory must stay free.
        :raises ValueError: when the request cannot be met (negative, or more than is free).
        """
        free = self.free_memory()
        if kv_cache_memory is None:
            budget = self.default_budget(free) - activation_peak
        elif isinstance(kv_cache_memory, float):
            if not 0.0 < kv_cache_memory <= 1.0:
                raise ValueError(
                    f"kv_cache_memory as a fraction must be in (0, 1], got {kv_cache_memory}"
                )
            budget = int(free * kv_cache_memory) - activation_peak
        else:
            if kv_cache_memory <= 0:
                raise ValueError(f"kv_cache_memory must be > 0 bytes, got {kv_cache_memory}")
            if kv_cache_memory > free:
                raise ValueError(
                    f"kv_cache_memory={kv_cache_memory} bytes exceeds the {free} bytes free"
                )
            budget = int(kv_cache_memory)
        if budget <= 0:
            raise ValueError(
                f"no memory left for the KV cache: {free} bytes free, "
                f"{activation_peak} needed for activations"
            )
        return budget

    def utilization_budget(self, utilization: float, held: int,
                           activation_peak: int = 0) -> int:
        """Bytes for the KV cache when the engine may hold ``utilization`` of the device's
        total memory (vLLM's ``gpu_memory_utilization``).

        :param held: what this process holds already (weights, runtime).
        :raises ValueError: when nothing is left for the KV cache, or more than is free.
        """
        budget = int(self.total_memory() * utilization) - held - activation_peak
        free = self.free_memory()
        if budget <= 0:
            raise ValueError(
                f"gpu_memory_utilization={utilization} leaves no memory for the KV cache: "
                f"{self.total_memory()} bytes in all, {held} held by this process, "
                f"{activation_peak} needed for activations")
        if budget > free:
            raise ValueError(
                f"gpu_memory_utilization={utilization} asks {budget} bytes for the KV "
                f"cache, but only {free} are free (other processes hold the rest)")
        return budget

    def default_budget(self, free: int) -> int:
        """Budget when the user gave none. Platforms override to suit their memory."""
        return int(free * 0.9)

    def num_kv_blocks(self, budget: int, bytes_per_block: int) -> int:
        """How many KV pages fit ``budget`` when one page (all layers) is ``bytes_per_block``.

        :raises ValueError: when not even one page fits.
        """
        if bytes_per_block <= 0:
            raise ValueError(f"bytes_per_block must be > 0, got {bytes_per_block}")
        n = budget // bytes_per_block
        if n < 1:
            raise ValueError(
                f"the KV budget of {budget} bytes holds no page of {bytes_per_block} bytes; "
                "raise kv_cache_memory"
            )
        return int(n)
