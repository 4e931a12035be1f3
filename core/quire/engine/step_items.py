"""The engine's side of a step's wire form: :class:`~quire.executor.messages.StepItem` s
built from the scheduler's :class:`~quire.engine.scheduler.ScheduledSeq` s.

:class:`ItemBuilder` remembers what every worker's
:class:`~quire.executor.input_batch.InputBatch` holds, so that a sequence's pages cross
to the workers once; the executor's messages know nothing of the engine's types.
"""

from __future__ import annotations

from collections.abc import Mapping

from quire.engine.scheduler import ScheduledSeq
from quire.engine.speculation import DraftKV
from quire.executor.messages import PENDING_TOKEN, StepItem
from quire.multimodal.inputs import spans_in
from quire.multimodal.mrope import mrope_positions


def step_item(s: ScheduledSeq, first_page: int = 0, prev_row: int = -1,
              draft_kv: DraftKV | None = None) -> StepItem:
    """What the forward needs of one scheduled sequence, with its pages from
    ``first_page`` on (the whole table by default); ``prev_row`` holds its pending
    token, if the step reaches it; its drafts follow its known tokens. ``draft_kv``:
    the step runs a draft model or an EAGLE head in the workers, which gets the tokens
    its K/V lacks."""
    # per sequence per step: ScheduledSeq's and Sequence's properties inlined
    seq, start = s.seq, s.start
    spec = s.spec
    end = start + s.num_tokens - len(spec)
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
    if spec:
        tokens.extend(spec)
    rows = 0
    if seq.params.prompt_logprobs is not None:
        rows = max(0, min(end, n_prompt - 1) - start)
    # the whole table is shared, not copied: the runner only reads it, and a process
    # boundary copies anyway
    table = seq.block_table[first_page:] if first_page else seq.block_table
    samples = end == num_tokens + seq.num_pending_tokens  # s.samples
    lag = draft_kv.lag(seq, start) if draft_kv is not None else []
    mm_spans = spans_in(seq.mm_items, start, end) if seq.mm_items else []
    # an M-RoPE model's images carry their grids; text-only sequences need no positions
    mrope = (mrope_positions(seq.mm_items, start, start + len(tokens))
             if seq.mm_items and seq.mm_items[0].grid else [])
    return StepItem(seq.seq_id, tokens, start, table, samples, rows, first_page, prev_row,
                    len(spec), lag, seq.lora_id,
                    seq.lora_path if seq.lora_id and not first_page else "",
                    list(s.encode), mm_spans, mrope)


class ItemBuilder:
    """Builds each step's items so that a sequence's pages cross to the workers once,
    and collects the sequences they may forget. Plans must reach every worker in the
    order they were built."""

    def __init__(self, draft_kv: DraftKV | None = None) -> None:
        """:param draft_kv: a draft model's or an EAGLE head's K/V (:func:`step_item`)."""
        self.draft_kv = draft_kv
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
        draft_kv = self.draft_kv
        if draft_kv is not None and not draft_kv.runs(scheduled):
            draft_kv = None  # the drafter skips the step: nothing to send
        out = []
        for s in scheduled:
            seq = s.seq
            preemptions, pages = known.get(seq.seq_id, (-1, 0))
            out.append(step_item(s, pages if preemptions == seq.num_preemptions else 0,
                                 rows.get(seq.seq_id, -1), draft_kv))
            known[seq.seq_id] = (seq.num_preemptions, len(seq.block_table))
        return out

    def truncate(self, seq_id: int, num_pages: int) -> None:
        """``seq_id``'s table shrank to ``num_pages`` (pages of rejected drafts went
        back): the next item sends its pages from there on, over the stale ones."""
        entry = self._known.get(seq_id)
        if entry is not None and entry[1] > num_pages:
            self._known[seq_id] = (entry[0], num_pages)

    def release(self, seq_id: int) -> None:
        """``seq_id`` finished or lost its pages (preempted): the next plan tells the
        workers to drop its table, and a later step sends its table whole."""
        if self._known.pop(seq_id, None) is not None:
            self._released.append(seq_id)

    def take_released(self) -> list[int]:
        """The sequences released since the previous call."""
        released, self._released = self._released, []
        return released
