"""What the ``mp`` and ``ray`` executors share: workers in other processes that answer
the same msgspec requests, so every call but the transport is written once here."""

from __future__ import annotations

from abc import abstractmethod

import torch

from quire.executor.abstract import Executor
from quire.executor.messages import (
    Call,
    Reply,
    Step,
    StepItem,
    StepPlan,
    resolve_pending,
)
from quire.executor.model_runner import StepResult
from quire.executor.worker import KVCacheSpec


class RemoteExecutor(Executor):
    """An executor whose workers live elsewhere; subclasses move the bytes."""

    runs_model_here = False
    _bytes_per_block = 0
    _releases = False

    def _started(self, replies: list[Reply]) -> None:
        """Take rank 0's start reply: its KV layers, KV heads, head size, page bytes,
        whether its backend gives KV memory back."""
        layers, kv_heads, head_size, page_bytes, releases = replies[0].values or [0] * 5
        self.kv_spec = KVCacheSpec(layers, kv_heads, head_size)
        self._bytes_per_block = page_bytes
        self._releases = bool(releases)
        #: (start, stop) pairs of pages to give back, sent with the next step.
        self._free_pages: list[int] = []

    @property
    def releases_kv_memory(self) -> bool:
        return self._releases

    def num_kv_blocks(self) -> int:
        return min(reply.value or 0 for reply in self._call(Call("num_kv_blocks", [])))

    def bytes_per_block(self) -> int:
        return self._bytes_per_block

    def init_cache(self, num_blocks: int) -> None:
        self._call(Call("init_cache", [num_blocks]))

    @abstractmethod
    def _send_all(self, request: Call | Step) -> object:
        """Send ``request`` to every rank without waiting; a handle for :meth:`_receive`."""

    @abstractmethod
    def _receive(self, handle: object) -> list[Reply]:
        """The replies to the oldest request sent (``handle``), in rank order.

        :raises WorkerDied: when a worker died or answered with an error.
        """

    def _call(self, request: Call | Step) -> list[Reply]:
        return self._receive(self._send_all(request))

    def execute(self, items: list[StepItem], released: list[int] | None = None) -> StepResult:
        return self.wait(self.submit(items, released))

    def submit(self, items: list[StepItem], released: list[int] | None = None,
               sampled: torch.Tensor | None = None) -> object:
        """Pending tokens are resolved here, on the host: the plan crosses a process
        boundary, and the core sampled them in this process anyway."""
        if sampled is not None:
            items = resolve_pending(items, sampled.tolist())
        free, self._free_pages = self._free_pages, []
        return self._send_all(Step(StepPlan(items, released or [], free)))

    def release_kv_pages(self, start: int, stop: int) -> None:
        """Sent with the next step: a call now could overtake a step in flight."""
        self._free_pages += [start, stop]

    def wait(self, handle: object) -> StepResult:
        """The logits come from the rank that has them (the last stage's first rank), a
        draft model's proposals from the rank that made them (the first stage's)."""
        outputs = [r.output for r in self._receive(handle) if r.output is not None]
        out = next(o for o in outputs if o.logits is not None)
        assert out.logits is not None
        drafts = next((o.drafts for o in outputs if o.drafts is not None), None)
        return StepResult(out.logits.tensor(), tuple(out.sample_items),
                          tuple((i, first, a.tensor()) for i, first, a in out.prompt_logits),
                          None if out.pooled is None else out.pooled.tensor(),
                          None if drafts is None else tuple(map(tuple, drafts)))
