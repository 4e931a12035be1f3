"""What the engine and its workers send each other, as msgspec structs.

A step travels as :class:`StepPlan`: per scheduled sequence only what the forward needs
(its new tokens, where they start, its page table, which logits are due), never the
``Sequence`` itself. Tensors travel as :class:`Array` (dtype, shape, raw bytes), so no
pickle crosses a process boundary; msgspec's msgpack encoding is both typed and fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec
import numpy as np
import torch

if TYPE_CHECKING:
    from quire.engine.scheduler import ScheduledSeq


class StepItem(msgspec.Struct, array_like=True, frozen=True):
    """One sequence's share of a step: tokens ``start .. start + len(token_ids)``."""

    token_ids: list[int]
    start: int
    #: Physical page ids, in order (the runner only reads them).
    block_table: list[int]
    #: The step reaches the sequence's last known token: its logits are sampled.
    samples: bool
    #: Prompt positions from ``start`` whose logits are due for prompt logprobs (0: none).
    prompt_logit_rows: int = 0

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)

    @classmethod
    def of(cls, s: ScheduledSeq) -> "StepItem":
        """What the forward needs of one scheduled sequence (the page table is shared,
        not copied: the runner only reads it, and a process boundary copies anyway)."""
        seq = s.seq
        rows = 0
        if seq.params.prompt_logprobs is not None:
            rows = max(0, min(s.end, seq.num_prompt_tokens - 1) - s.start)
        return cls(seq.token_slice(s.start, s.end), s.start, seq.block_table, s.samples,
                   rows)


class StepPlan(msgspec.Struct, array_like=True, frozen=True):
    """One forward for every rank."""

    items: list[StepItem]


class Array(msgspec.Struct, array_like=True, frozen=True):
    """A host tensor as bytes: ``dtype`` is a numpy dtype name."""

    dtype: str
    shape: list[int]
    data: bytes

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "Array":
        host = tensor.detach().to("cpu").contiguous().numpy()
        return cls(str(host.dtype), list(host.shape), host.tobytes())

    def tensor(self) -> torch.Tensor:
        array = np.frombuffer(self.data, dtype=self.dtype).reshape(self.shape)
        return torch.from_numpy(array.copy())


class StepOutput(msgspec.Struct, array_like=True, frozen=True):
    """A step's logits, from the first rank of the last pipeline stage (the other ranks
    reply with no output)."""

    logits: Array | None
    sample_items: list[int]
    #: (item index, first position, logits [k, vocab]) for prompt logprobs.
    prompt_logits: list[tuple[int, int, Array]]
    #: An embedding model's float32 [N, hidden] vectors, rows following ``sample_items``.
    pooled: Array | None = None


class Call(msgspec.Struct, array_like=True, frozen=True, tag=True):
    """A control call every worker runs: ``method(*args)`` on its :class:`Worker`."""

    method: str
    args: list[int]


class Step(msgspec.Struct, array_like=True, frozen=True, tag=True):
    plan: StepPlan


class Reply(msgspec.Struct, array_like=True, frozen=True):
    """A worker's answer: a value, a step's output, or the error it raised. The first
    reply, once the shard is loaded, carries ``values``: the rank's KV layers, KV heads,
    head size and bytes per page."""

    value: int | None = None
    values: list[int] | None = None
    output: StepOutput | None = None
    error: str | None = None


Request = Call | Step
