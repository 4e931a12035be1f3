"""``Drafter``: a draft model's proposals, made in the worker just before the target's
forward of the same step (speculative decoding with ``speculative_config.model``).

The engine schedules ``num_spec`` stand-in tokens behind a decoding sequence's last
token, with pages for them, as it does for n-gram drafts; only their values come from
here. In a step where some item drafts, the drafter runs its model:

1. over every item's tokens its K/V lacks (``draft_lag``: those the draft has not seen,
   from prefill chunks of steps without drafts, a prefix-cache hit, or the last draft
   of a step that accepted them all; then the item's known tokens), in forwards of at
   most the step's token budget, and takes the argmax after each drafting item's last
   known token: its first proposal;
2. then ``num_spec - 1`` one-token steps over its own proposals.

A step without drafts (speculation off at a large batch) runs no draft forward at all:
its items only update the draft's page tables, and the draft catches up when it next
drafts. Proposals are greedy, so they are deterministic (the verifier's rule for a
point-mass draft keeps the output exact at any temperature) and every tensor-parallel
rank makes the same ones. The draft's K/V lives in its own tensors under the target's
page ids: one page id holds a position for both models, so the engine's block manager
and its one budget cover both. A rejected draft's K/V is overwritten when its position
is reached again.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec
import torch
from torch import nn

from quire.executor.input_batch import InputBatch, StepLimits
from quire.executor.messages import StepItem
from quire.interfaces.attention import AttentionBackend
from quire.models.context import ForwardContext
from quire.ops import OpSet


class Drafter:
    """A draft model, its K/V tensors and its own input batch (the same page tables as
    the target's, fed the same deltas). One per model runner; not thread-safe."""

    def __init__(self, model: nn.Module, backend: AttentionBackend,
                 kv_caches: list[torch.Tensor | None], block_size: int,
                 device: torch.device, ops: OpSet, limits: StepLimits | None = None) -> None:
        """:param limits: the largest step: a catch-up forward holds at most its
            ``max_num_tokens`` tokens (no limit when None)."""
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.ops = ops
        self.input_batch = InputBatch(block_size, device, limits)
        self.max_tokens = limits.max_num_tokens if limits is not None else None

    @torch.inference_mode()
    def propose(self, items: list[StepItem], released: Iterable[int] = ()
                ) -> tuple[list[StepItem], tuple[tuple[int, ...], ...]]:
        """Write the draft's K/V for the step's known tokens and propose each drafting
        item's ``num_spec`` tokens.

        :returns: the items with their stand-ins replaced by the proposals, and each
            item's proposals (empty for an item without drafts).
        """
        proposals: list[list[int]] = [[] for _ in items]
        drafting = [i for i, item in enumerate(items) if item.num_spec > 0]
        if not drafting:
            self.input_batch.apply(items, released)
            return items, tuple(() for _ in items)
        tokens: list[int] = []
        for forward in self._catch_up(items):
            tokens += self._forward(forward, released)
            released = ()
        for i, token in zip(drafting, tokens, strict=True):
            proposals[i].append(token)
        for j in range(1, max((items[i].num_spec for i in drafting), default=0)):
            drafting = [i for i in drafting if items[i].num_spec > j]
            step = []
            for i in drafting:
                item = items[i]
                seq_id = item.seq_id
                step.append(StepItem(seq_id, [proposals[i][-1]],
                                     item.end - item.num_spec + j - 1, [], True,
                                     first_page=self.input_batch.num_pages_of(seq_id)))
            for i, token in zip(drafting, self._forward(step), strict=True):
                proposals[i].append(token)
        filled = [item if not item.num_spec else msgspec.structs.replace(
                      item, token_ids=item.token_ids[: len(item.token_ids) - item.num_spec]
                      + proposals[i])
                  for i, item in enumerate(items)]
        return filled, tuple(tuple(p) for p in proposals)

    def _catch_up(self, items: list[StepItem]) -> list[list[StepItem]]:
        """The catch-up forwards: each item's lag and known tokens, split so that no
        forward holds more than ``max_tokens``; a drafting item samples at its end."""
        forwards: list[list[StepItem]] = [[]]
        room = self.max_tokens
        for item in items:
            tokens = item.draft_lag + item.token_ids[: len(item.token_ids) - item.num_spec]
            start = item.start - len(item.draft_lag)
            table, first_page = item.block_table, item.first_page
            while tokens:
                if room == 0:
                    forwards.append([])
                    room = self.max_tokens
                take = len(tokens) if room is None else min(room, len(tokens))
                last = take == len(tokens)
                forwards[-1].append(StepItem(item.seq_id, tokens[:take], start, table,
                                             last and item.num_spec > 0,
                                             first_page=first_page))
                tokens, start = tokens[take:], start + take
                first_page, table = first_page + len(table), []
                if room is not None:
                    room -= take
        return forwards

    def _forward(self, items: list[StepItem], released: Iterable[int] = ()) -> list[int]:
        """One forward of the draft over ``items``; the argmax at each sampling item's
        last token."""
        inputs = self.input_batch.prepare(items, released)
        ctx = ForwardContext(backend=self.backend,
                             metadata=self.backend.build_metadata(inputs.batch),
                             kv_caches=self.kv_caches, ops=self.ops, batch=inputs.batch)
        hidden = self.model(inputs.input_ids, inputs.positions, ctx)
        if not inputs.sample_items:
            return []
        logits = self.model.compute_logits(hidden[inputs.sample_rows])
        return logits.argmax(dim=-1).tolist()
