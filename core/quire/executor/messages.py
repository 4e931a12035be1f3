"""What the engine and its workers send each other, as msgspec structs.

A step travels as :class:`StepPlan`: per scheduled sequence only what the forward needs
(its new tokens, where they start, the pages of its table the workers have not seen,
which logits are due), never the ``Sequence`` itself, and the sequences the workers may
forget. :class:`ItemBuilder` remembers, on the engine's side, what every worker's
:class:`~quire.executor.input_batch.InputBatch` holds. Tensors travel as :class:`Array`
(dtype, shape, raw bytes), so no pickle crosses a process boundary; msgspec's msgpack
encoding is both typed and fast.

With async scheduling a step may be built before the previous step's sampled tokens reach
the host: such a sequence's last new token is :data:`PENDING_TOKEN`, and its item's
``prev_row`` names the row of the previous step's sampled token ids that holds it. The
executor fills it in: on the device for the in-process runner, on the host
(:func:`resolve_pending`) before a plan crosses to worker processes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import msgspec
import numpy as np
import torch

if TYPE_CHECKING:
    from quire.engine.scheduler import ScheduledSeq


#: The stand-in id of a token sampled on the device and not yet on the host.
PENDING_TOKEN = -1


class StepItem(msgspec.Struct, array_like=True, frozen=True):
    """One sequence's share of a step: tokens ``start .. start + len(token_ids)``."""

    #: The sequence's id: the workers keep its page table across steps under it.
    seq_id: int
    token_ids: list[int]
    start: int
    #: Physical page ids from page ``first_page`` on, in order: the whole table when
    #: ``first_page`` is 0, else only the pages added since the workers last saw it (the
    #: runner only reads them). The table is the first ``first_page`` pages held, then these.
    block_table: list[int]
    #: The step reaches the sequence's last known token: its logits are sampled.
    samples: bool
    #: Prompt positions from ``start`` whose logits are due for prompt logprobs (0: none).
    prompt_logit_rows: int = 0
    first_page: int = 0
    #: -1, or the row of the previous step's sampled token ids that holds the last of
    #: ``token_ids`` (then :data:`PENDING_TOKEN`; async scheduling).
    prev_row: int = -1

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)

    @classmethod
    def of(cls, s: ScheduledSeq, first_page: int = 0, prev_row: int = -1) -> "StepItem":
        """What the forward needs of one scheduled sequence, with its pages from
        ``first_page`` on (the whole table by default); ``prev_row`` holds its pending
        token, if the step reaches it."""
        # per sequence per step: ScheduledSeq's and Sequence's properties inlined
        seq, start = s.seq, s.start
        end = start + s.num_tokens
        n_prompt = len(seq.prompt_token_ids)
        num_tokens = n_prompt + len(seq.output_token_ids)
        if end == num_tokens and start == num_tokens - 1 and start >= n_prompt:
            tokens = [seq.output_token_ids[-1]]  # a decode step's one token
        else:
            tokens = seq.token_slice(start, min(end, num_tokens))
        if end > num_tokens:  # the pending token: on the device, not here
            if prev_row < 0 or end != num_tokens + 1:
                raise ValueError(f"sequence {seq.seq_id} is scheduled up to {end} with "
                                 f"{num_tokens} tokens on the host and no sampled row")
            tokens.append(PENDING_TOKEN)
        else:
            prev_row = -1
        rows = 0
        if seq.params.prompt_logprobs is not None:
            rows = max(0, min(end, n_prompt - 1) - start)
        # the whole table is shared, not copied: the runner only reads it, and a process
        # boundary copies anyway
        table = seq.block_table[first_page:] if first_page else seq.block_table
        samples = end == num_tokens + seq.num_pending_tokens  # s.samples
        return cls(seq.seq_id, tokens, start, table, samples, rows, first_page, prev_row)


def resolve_pending(items: list[StepItem], sampled: list[int]) -> list[StepItem]:
    """``items`` with each pending token replaced by its id from ``sampled`` (the
    previous step's sampled token ids, on the host)."""
    return [item if item.prev_row < 0 else msgspec.structs.replace(
                item, token_ids=[*item.token_ids[:-1], sampled[item.prev_row]], prev_row=-1)
            for item in items]


class ItemBuilder:
    """The engine's side of the persistent input batch: builds each step's items so
    that a sequence's pages cross to the workers once, and collects the sequences they
    may forget. Plans must reach every worker in the order they were built."""

    def __init__(self) -> None:
        # seq_id -> (its preemptions, pages the workers hold for it): a preempted
        # sequence's table starts over, whether or not it was released
        self._known: dict[int, tuple[int, int]] = {}
        self._released: list[int] = []

    def items(self, scheduled: list[ScheduledSeq],
              pending_rows: Mapping[int, int] | None = None) -> list[StepItem]:
        """The step's items; afterwards the workers are taken to hold every page.

        :param pending_rows: seq_id -> its row of the previous step's sampled token ids,
            for the sequences whose last token is pending (async scheduling)."""
        known = self._known
        rows = pending_rows or {}
        out = []
        for s in scheduled:
            seq = s.seq
            preemptions, pages = known.get(seq.seq_id, (-1, 0))
            out.append(StepItem.of(s, pages if preemptions == seq.num_preemptions else 0,
                                   rows.get(seq.seq_id, -1)))
            known[seq.seq_id] = (seq.num_preemptions, len(seq.block_table))
        return out

    def release(self, seq_id: int) -> None:
        """``seq_id`` finished or lost its pages (preempted): the next plan tells the
        workers to drop its table, and a later step sends its table whole."""
        if self._known.pop(seq_id, None) is not None:
            self._released.append(seq_id)

    def take_released(self) -> list[int]:
        """The sequences released since the previous call."""
        released, self._released = self._released, []
        return released


class StepPlan(msgspec.Struct, array_like=True, frozen=True):
    """One forward for every rank."""

    items: list[StepItem]
    #: Sequences to forget before the step (finished, aborted or preempted).
    released: list[int] = msgspec.field(default_factory=list)


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
