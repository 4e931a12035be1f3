"""``uni``: the only worker runs in the engine's own process, called directly."""

from __future__ import annotations

import torch

from quire.config import EngineConfig
from quire.executor.abstract import Executor
from quire.executor.messages import StepItem
from quire.executor.model_runner import StepResult
from quire.executor.worker import Worker
from quire.plugins.registry import PlatformRegistry


class UniProcExecutor(Executor):
    """World size 1, no process boundary: a step costs a method call."""

    world_size = 1
    runs_model_here = True

    def __init__(self, config: EngineConfig, registry: PlatformRegistry) -> None:
        self.worker = Worker(config, 0, 1, registry)
        self.kv_spec = self.worker.kv_spec

    def num_kv_blocks(self) -> int:
        return self.worker.num_kv_blocks()

    def bytes_per_block(self) -> int:
        return self.worker.bytes_per_block()

    def init_cache(self, num_blocks: int) -> None:
        self.worker.init_cache(num_blocks)

    def release_kv_pages(self, start: int, stop: int) -> None:
        self.worker.release_kv_pages(start, stop)

    @property
    def releases_kv_memory(self) -> bool:
        return self.worker.backend.releases_kv_memory

    def execute(self, items: list[StepItem], released: list[int] | None = None) -> StepResult:
        return self.worker.execute(items, released or ())

    def submit(self, items: list[StepItem], released: list[int] | None = None,
               sampled: torch.Tensor | None = None) -> object:
        """The pending tokens stay on the device: the runner copies them into its
        inputs there (no host round trip)."""
        return self.worker.execute(items, released or (), sampled)

    def shutdown(self) -> None:
        pass
