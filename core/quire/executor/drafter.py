"""``Drafter``: a draft model's proposals, made in the worker just before the target's
forward of the same step (speculative decoding with ``speculative_config.model``).

The engine schedules ``num_spec`` stand-in tokens behind a decoding sequence's last
token, with pages for them, as it does for n-gram drafts; only their values come from
here. Per step the drafter runs its model:

1. over every item's known tokens (and the ``draft_lag`` tokens before them, whose draft
   K/V is missing: the last draft of a step that accepted them all), so that the
   draft's K/V follows the target's through prefill chunks and decoding alike, and takes
   the argmax after each drafting item's last known token: its first proposal;
2. then ``num_spec - 1`` one-token steps over its own proposals.

Proposals are greedy, so they are deterministic (the verifier's rule for a point-mass
draft keeps the output exact at any temperature) and every tensor-parallel rank makes
the same ones. The draft's K/V lives in its own tensors under the target's page ids:
one page id holds a position for both models, so the engine's block manager and its one
budget cover both. A rejected draft's K/V is overwritten when its position is reached
again.
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
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.ops = ops
        self.input_batch = InputBatch(block_size, device, limits)

    @torch.inference_mode()
    def propose(self, items: list[StepItem], released: Iterable[int] = ()
                ) -> tuple[list[StepItem], tuple[tuple[int, ...], ...]]:
        """Write the draft's K/V for the step's known tokens and propose each drafting
        item's ``num_spec`` tokens.

        :returns: the items with their stand-ins replaced by the proposals, and each
            item's proposals (empty for an item without drafts).
        """
        catch_up = [StepItem(item.seq_id,
                             item.draft_lag + item.token_ids[: len(item.token_ids)
                                                             - item.num_spec],
                             item.start - len(item.draft_lag), item.block_table,
                             item.num_spec > 0, first_page=item.first_page)
                    for item in items]
        proposals: list[list[int]] = [[] for _ in items]
        drafting = [i for i, item in enumerate(items) if item.num_spec > 0]
        tokens = self._forward(catch_up, released)
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
