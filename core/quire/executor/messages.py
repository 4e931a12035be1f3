"""What the engine and its workers send each other, as msgspec structs.

A step travels as :class:`StepPlan`: per scheduled sequence only what the forward needs
(its new tokens, where they start, the pages of its table the workers have not seen,
which logits are due), never the ``Sequence`` itself, and the sequences the workers may
forget. The engine builds the items (:mod:`quire.engine.step_items`); nothing here
knows the engine's types. Tensors travel as :class:`Array`
(dtype, shape, raw bytes), so no pickle crosses a process boundary; msgspec's msgpack
encoding is both typed and fast.

With async scheduling a step may be built before the previous step's sampled tokens reach
the host: such a sequence's last new token is :data:`PENDING_TOKEN`, and its item's
``prev_row`` names the row of the previous step's sampled token ids that holds it. The
executor fills it in: on the device for the in-process runner, on the host
(:func:`resolve_pending`) before a plan crosses to worker processes.
"""

from __future__ import annotations

import msgspec

from quire.executor.array import Array
from quire.multimodal.inputs import MMItem, MMSpan

__all__ = [
    "PENDING_TOKEN",
    "Array",
    "Call",
    "MMItem",
    "MMSpan",
    "Reply",
    "Step",
    "StepItem",
    "StepOutput",
    "StepPlan",
    "resolve_pending",
]

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
    #: The last ``num_spec`` of ``token_ids`` are draft tokens (speculative decoding):
    #: when the item samples, logits are due at each of them and at the token before.
    num_spec: int = 0
    #: With a draft model (the runner has a drafter): the sequence's tokens just before
    #: ``start`` whose draft K/V is not in the pages yet (at most one after a step that
    #: accepted every draft). The last ``num_spec`` of ``token_ids`` are then stand-ins
    #: that the drafter replaces with its proposals before the target's forward.
    draft_lag: list[int] = msgspec.field(default_factory=list)
    #: The LoRA adapter the sequence runs with (0: the base model), and its path when
    #: the item sends the whole table (the workers keep it by id from then on).
    lora_id: int = 0
    lora_path: str = ""
    #: Images whose embeddings the workers compute in this step (an image-text model),
    #: before the forward: each the first time a step reaches its placeholder tokens
    #: while no worker holds it (:mod:`quire.engine.encoder_cache`).
    mm_encode: list[MMItem] = msgspec.field(default_factory=list)
    #: Rows of ``token_ids`` that take image embeddings instead of token embeddings.
    mm_spans: list[MMSpan] = msgspec.field(default_factory=list)
    #: An M-RoPE model's sequence with images: the (time, height, width) positions of
    #: ``token_ids``, three rows one after the other (``3 * len(token_ids)`` ints); empty:
    #: each token's three positions are its index in the sequence.
    mrope_positions: list[int] = msgspec.field(default_factory=list)

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


def resolve_pending(items: list[StepItem], sampled: list[int]) -> list[StepItem]:
    """``items`` with each pending token replaced by its id from ``sampled`` (the
    previous step's sampled token ids, on the host)."""
    return [item if item.prev_row < 0 else msgspec.structs.replace(
                item, token_ids=[*item.token_ids[:-1], sampled[item.prev_row]], prev_row=-1)
            for item in items]


class StepPlan(msgspec.Struct, array_like=True, frozen=True):
    """One forward for every rank."""

    items: list[StepItem]
    #: Sequences to forget before the step (finished, aborted or preempted).
    released: list[int] = msgspec.field(default_factory=list)
    #: (start, stop) pairs, flat, of KV pages whose memory goes back before the step.
    free_pages: list[int] = msgspec.field(default_factory=list)


class StepOutput(msgspec.Struct, array_like=True, frozen=True):
    """A step's logits, from the first rank of the last pipeline stage (the other ranks
    reply with no output)."""

    logits: Array | None
    sample_items: list[int]
    #: (item index, first position, logits [k, vocab]) for prompt logprobs.
    prompt_logits: list[tuple[int, int, Array]]
    #: An embedding model's float32 [N, hidden] vectors, rows following ``sample_items``.
    pooled: Array | None = None
    #: With a draft model: each item's proposals (empty for items without drafts).
    drafts: list[list[int]] | None = None


class Call(msgspec.Struct, array_like=True, frozen=True, tag=True):
    """A control call every worker runs: ``method(*args)`` on its :class:`Worker`."""

    method: str
    args: list[int]


class Step(msgspec.Struct, array_like=True, frozen=True, tag=True):
    plan: StepPlan


class Reply(msgspec.Struct, array_like=True, frozen=True):
    """A worker's answer: a value, a step's output, or the error it raised. The first
    reply, once the shard is loaded, carries ``values``: the rank's KV layers, KV heads,
    head size, bytes per page and whether its backend gives KV memory back (1 or 0)."""

    value: int | None = None
    values: list[int] | None = None
    output: StepOutput | None = None
    error: str | None = None


Request = Call | Step
