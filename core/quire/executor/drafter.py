"""``Drafter``: a draft model's proposals, made in the worker just before the target's
forward of the same step (speculative decoding with ``speculative_config.model``);
``EagleDrafter``: an EAGLE head's (or the target's own MTP layers'), the same way.

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

With pipeline stages a draft model runs on the first stage, where the step's tokens
enter. An EAGLE or MTP head runs on the last, which holds the target's hidden states and
LM head (and a copy of its embedding): it proposes before that stage's part of the
forward and sends the proposals to the first stage, whose :class:`StageProposals` puts
them in place of the stand-ins.

With async scheduling a step's last known token may still be on the device (the item's
``prev_row``): the drafter's forward that reads it takes it from the same sampled ids as
the target's (:meth:`InputBatch.prepare`), so an EAGLE or MTP head keeps its K/V in the
asynchronous steps that draft nothing.
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
from quire.models.pipeline import PipelineLink
from quire.ops import OpSet


def _fill(items: list[StepItem], proposals: list[list[int]]) -> list[StepItem]:
    """``items`` with each drafting item's stand-ins replaced by its proposals."""
    return [item if not item.num_spec else msgspec.structs.replace(
                item, token_ids=item.token_ids[: len(item.token_ids) - item.num_spec]
                + proposals[i])
            for i, item in enumerate(items)]


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
    def propose(self, items: list[StepItem], released: Iterable[int] = (),
                sampled: torch.Tensor | None = None
                ) -> tuple[list[StepItem], tuple[tuple[int, ...], ...]]:
        """Write the draft's K/V for the step's known tokens and propose each drafting
        item's ``num_spec`` tokens.

        :param sampled: the previous step's sampled token ids on this device, for items
            whose last token is pending (``StepItem.prev_row``, async scheduling: items
            without drafts, since async steps draft nothing).
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
            tokens += self._forward(forward, released, sampled)
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
        return _fill(items, proposals), tuple(tuple(p) for p in proposals)

    def keep(self, items: list[StepItem], hidden: torch.Tensor) -> None:
        """A draft model reads no hidden state of the target's."""

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
                                             first_page=first_page,
                                             prev_row=-1 if item.num_spec or not last
                                             else item.prev_row))
                tokens, start = tokens[take:], start + take
                first_page, table = first_page + len(table), []
                if room is not None:
                    room -= take
        return forwards

    def _forward(self, items: list[StepItem], released: Iterable[int] = (),
                 sampled: torch.Tensor | None = None) -> list[int]:
        """One forward of the draft over ``items``; the argmax at each sampling item's
        last token."""
        inputs = self.input_batch.prepare(items, released, sampled)
        ctx = ForwardContext(backend=self.backend,
                             metadata=self.backend.build_metadata(inputs.batch),
                             kv_caches=self.kv_caches, ops=self.ops, batch=inputs.batch)
        hidden = self.model(inputs.input_ids, inputs.positions, ctx)
        if not inputs.sample_items:
            return []
        logits = self.model.compute_logits(hidden[inputs.sample_rows])
        return logits.argmax(dim=-1).tolist()


class EagleDrafter:
    """An EAGLE or EAGLE-3 head's proposals (:mod:`quire.models.eagle`), or an MTP
    head's (:mod:`quire.models.mimo`), made in the worker just before the target's
    forward, from the target's hidden states of the step before.

    Head position ``i`` reads token ``i + 1`` and the target's hidden state at ``i``.
    The runner hands over each step's hidden states (:meth:`keep`); the next step writes
    the head's K/V at the positions they cover up to the item's start (the engine sends
    the tokens there, ``draft_lag``), which takes every accepted token, and the argmax
    after the last is the first proposal. ``num_spec - 1`` one-token steps follow, each
    reading the head's own output as the hidden state. Their K/V is rewritten from the
    target's hidden states once accepted (the engine counts only up to the start).
    Runs every step, so that no hidden state is lost; one per model runner. The head is
    told the draft step (0 for the forward over the target's hidden states): an MTP
    head runs its layer of that step, an EAGLE head its one network for all.
    """

    def __init__(self, head: nn.Module, backend: AttentionBackend,
                 kv_caches: list[torch.Tensor | None], block_size: int,
                 device: torch.device, ops: OpSet, limits: StepLimits | None = None,
                 link: PipelineLink | None = None) -> None:
        """:param link: on the last of several pipeline stages, the link its proposals
            go to the first stage by (:meth:`PipelineLink.send_proposals`)."""
        self.head = head
        self.link = link
        self.backend = backend
        self.kv_caches = kv_caches
        self.ops = ops
        self.input_batch = InputBatch(block_size, device, limits)
        #: seq_id -> (first position, the target's hidden states from it on)
        self._hidden: dict[int, tuple[int, torch.Tensor]] = {}

    def keep(self, items: list[StepItem], hidden: torch.Tensor) -> None:
        """The target's hidden states of a step, [T, H] in the items' token order (what
        the head reads of them: an EAGLE-3 head its three layers')."""
        # a copy: a replayed graph's output buffer is reused
        hidden = self.head.target_features(hidden).detach().clone()
        row = 0
        for item in items:
            n = len(item.token_ids)
            self._hidden[item.seq_id] = (item.start, hidden[row : row + n])
            row += n

    @torch.inference_mode()
    def propose(self, items: list[StepItem], released: Iterable[int] = (),
                sampled: torch.Tensor | None = None
                ) -> tuple[list[StepItem], tuple[tuple[int, ...], ...]]:
        """As :meth:`Drafter.propose`. The forward over the target's hidden states reads
        the item's first token last: when that one is pending, from ``sampled``."""
        for seq_id in released:
            self._hidden.pop(seq_id, None)
        forward: list[StepItem] = []
        features: list[torch.Tensor] = []
        idle: list[StepItem] = []
        drafting: list[int] = []  # items whose last head position is start - 1
        for i, item in enumerate(items):
            first = item.start - len(item.draft_lag)
            kept = self._hidden.get(item.seq_id)
            low = first if kept is None else max(first, kept[0])
            if kept is None or item.start == 0 or kept[0] + len(kept[1]) < item.start \
                    or low >= item.start:
                idle.append(item)
                continue
            # position j reads token j + 1: the lag's after the first, then the item's
            tokens = (item.draft_lag + item.token_ids[:1])[low + 1 - first :]
            # a pending token is the item's last: read here only when it is its only one
            pending = item.prev_row if len(item.token_ids) == 1 else -1
            forward.append(StepItem(item.seq_id, tokens, low, item.block_table,
                                    item.num_spec > 0, first_page=item.first_page,
                                    prev_row=pending))
            features.append(kept[1][low - kept[0] : item.start - kept[0]])
            if item.num_spec > 0:
                drafting.append(i)
        self.input_batch.apply(idle, released)
        proposals: list[list[int]] = [[] for _ in items]
        if forward:
            tokens, own = self._forward(forward, torch.cat(features), 0, sampled)
            for i, token in zip(drafting, tokens, strict=True):
                proposals[i].append(token)
            for j in range(1, max((items[i].num_spec for i in drafting), default=0)):
                keep = [k for k, i in enumerate(drafting) if items[i].num_spec > j]
                drafting = [drafting[k] for k in keep]
                own = own[keep]
                step = [StepItem(items[i].seq_id, [proposals[i][-1]],
                                 items[i].start - 1 + j, [], True,
                                 first_page=self.input_batch.num_pages_of(items[i].seq_id))
                        for i in drafting]
                tokens, own = self._forward(step, own, j)
                for i, token in zip(drafting, tokens, strict=True):
                    proposals[i].append(token)
        for i, item in enumerate(items):
            n = item.num_spec
            if n and len(proposals[i]) < n:  # no hidden state to draft from: any tokens do
                proposals[i] = [item.token_ids[0]] * n
        if self.link is not None:  # the first stage waits for them
            flat = [token for p in proposals for token in p]
            if flat:
                self.link.send_proposals(torch.tensor(flat, dtype=torch.int64,
                                                      device=self.link.device))
        return _fill(items, proposals), tuple(tuple(p) for p in proposals)

    def _forward(self, items: list[StepItem], features: torch.Tensor, step: int,
                 sampled: torch.Tensor | None = None) -> tuple[list[int], torch.Tensor]:
        """One forward of the head for draft ``step`` (0: from the target's hidden
        states); the argmax and the head's hidden state at each sampling item's last
        position."""
        inputs = self.input_batch.prepare(items, sampled=sampled)
        ctx = ForwardContext(backend=self.backend,
                             metadata=self.backend.build_metadata(inputs.batch),
                             kv_caches=self.kv_caches, ops=self.ops, batch=inputs.batch)
        hidden = self.head(inputs.input_ids, inputs.positions, ctx, features, step)
        if not inputs.sample_items:
            return [], hidden[:0]
        own = hidden[inputs.sample_rows]
        return self.head.propose(own).tolist(), own


class StageProposals:
    """The first pipeline stage's drafter when an EAGLE or MTP head runs on the last
    stage: each step that drafts, it receives the head's proposals (each drafting item's
    ``num_spec``, in item order) and puts them in place of the stand-ins before the
    first stage's forward. It holds no model and no K/V."""

    def __init__(self, link: PipelineLink) -> None:
        self.link = link
        self.kv_caches: list[torch.Tensor | None] = []

    def propose(self, items: list[StepItem], released: Iterable[int] = (),
                sampled: torch.Tensor | None = None
                ) -> tuple[list[StepItem], tuple[tuple[int, ...], ...]]:
        """As :meth:`Drafter.propose`; blocks until the last stage has proposed."""
        count = sum(item.num_spec for item in items)
        if not count:
            return items, tuple(() for _ in items)
        flat = self.link.recv_proposals(count).tolist()
        proposals: list[list[int]] = []
        for item in items:
            proposals.append(flat[: item.num_spec])
            flat = flat[item.num_spec :]
        return _fill(items, proposals), tuple(tuple(p) for p in proposals)

    def keep(self, items: list[StepItem], hidden: torch.Tensor) -> None:
        """The head keeps the hidden states, on the last stage."""
