"""The executor contract: how the engine runs a step on every rank of its model.

The engine core (scheduler, block manager, sampler) lives in one process; an executor
owns the workers that hold the model's shards and hands each step to all of them. Only
one rank's logits come back (the first rank of the last pipeline stage): the LM head
gathers the whole vocabulary on every tensor-parallel rank.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from quire.executor.messages import StepItem, resolve_pending
from quire.executor.model_runner import StepResult
from quire.executor.worker import KVCacheSpec


class WorkerDied(RuntimeError):
    """A worker process ended or failed; the executor can run no more steps."""


class Executor(ABC):
    """Runs the ranks of one model replica. Call order: :meth:`num_kv_blocks`,
    :meth:`init_cache`, then :meth:`execute` per step, and :meth:`shutdown` last."""

    #: Ranks of the replica: tensor x pipeline parallel size.
    world_size: int
    #: Whether the model runs in the engine's own process (then the engine's torch
    #: threads are the model's; otherwise the engine only samples).
    runs_model_here: bool
    #: Rank 0's KV shape facts (every rank holds the same number of pages).
    kv_spec: KVCacheSpec

    @abstractmethod
    def num_kv_blocks(self) -> int:
        """KV pages every rank can hold: the smallest over the ranks.

        :raises WorkerDied: when a worker failed (the message names the rank and why).
        """

    @abstractmethod
    def bytes_per_block(self) -> int:
        """Bytes one KV page takes on rank 0, over every layer."""

    @abstractmethod
    def init_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` pages per layer on every rank."""

    @abstractmethod
    def release_kv_pages(self, start: int, stop: int) -> None:
        """Pages ``[start, stop)`` hold nothing any sequence needs: every rank gives their
        memory back where its backend can (``AttentionBackend.release_kv_pages``), before
        its next step at the latest. Steps in flight may still write them: harmless, as
        no sequence reads them before writing them again."""

    @property
    @abstractmethod
    def releases_kv_memory(self) -> bool:
        """Whether :meth:`release_kv_pages` gives memory back (rank 0's backend says)."""

    @abstractmethod
    def execute(self, items: list[StepItem], released: list[int] | None = None) -> StepResult:
        """One forward on every rank; the logits of the rank that has them. Each rank
        forgets the ``released`` sequences first (see :class:`~quire.engine.step_items.
        ItemBuilder`).

        :raises WorkerDied: when a worker died or raised (the step is lost).
        """

    #: Steps that may be in flight at once: the pipeline's stages each work on another
    #: micro-batch. 1 where ranks cannot run ahead (no pipeline, or one process).
    max_in_flight: int = 1

    def submit(self, items: list[StepItem], released: list[int] | None = None,
               sampled: torch.Tensor | None = None) -> object:
        """Start a step and return a handle for :meth:`wait`, without waiting for it
        where the workers run elsewhere; steps complete in submission order.

        :param sampled: the previous step's sampled token ids (int64 [N], on the device
            of its logits), for the items whose ``prev_row`` points into it (async
            scheduling). Here they are read on the host and written into the items;
            an executor whose runner shares the device may copy them there instead.
        """
        if sampled is not None:
            items = resolve_pending(items, sampled.tolist())
        return self.execute(items, released)

    def wait(self, handle: object) -> StepResult:
        """The result of the oldest step not yet waited for (``handle``).

        :raises WorkerDied: when a worker died or raised.
        """
        assert isinstance(handle, StepResult)
        return handle

    def check_health(self) -> None:
        """Called while idle, so that a worker that died between steps is noticed before
        the next request comes; in-process ranks cannot die alone.

        :raises WorkerDied: naming the rank.
        """

    @abstractmethod
    def shutdown(self) -> None:
        """Stop every worker and release its resources; safe to call more than once."""
