"""Repetition, presence and frequency penalties, from per-row token counts.

:class:`PenaltyState` holds, for the rows of one batch composition that use a penalty,
the count of every token in the output so far ([P, V] float32) and, when a row uses the
repetition penalty, which tokens the prompt or the output hold ([P, V] bool). Both follow
the sequences step by step: :meth:`PenaltyState.update` adds only the tokens appended
since the previous call (normally one per row), and a new composition takes over the rows
of sequences it shares with the previous one instead of recounting them. Counting is a
``scatter_add`` over flattened (row, token) positions -- no Python loop over tokens.

Semantics (vLLM's ``apply_penalties``, in this order):

* repetition ``r`` on tokens in the prompt or the output: ``l / r`` if ``l > 0`` else
  ``l * r``;
* frequency ``f``: ``l -= f * count_in_output``;
* presence ``p``: ``l -= p * (count_in_output > 0)``.
"""

from __future__ import annotations

import itertools

import torch

from quire.sampling.rows import SamplingRow


def uses_penalties(seq: SamplingRow) -> bool:
    p = seq.params
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 \
        or p.frequency_penalty != 0.0


class PenaltyState:
    """Token counts for the penalised rows of one batch composition.

    :param seqs: the whole batch, in row order.
    :param rows: the rows (indices into ``seqs``) that use a penalty; not empty.
    :param previous: the state of the previous composition; rows that hold the same
        output list in both are copied from it. It must not be used afterwards.
    """

    def __init__(self, seqs: list[SamplingRow], rows: list[int], vocab_size: int,
                 device: torch.device, previous: PenaltyState | None = None):
        self.vocab_size = vocab_size
        self.seqs = [seqs[r] for r in rows]
        self.rows = torch.tensor(rows, dtype=torch.long, device=device)
        #: True when the penalised rows are the whole batch (no gather/scatter needed).
        self.all_rows = len(rows) == len(seqs)
        params = [s.params for s in self.seqs]
        self.repetition = _column([p.repetition_penalty for p in params], device)
        self.frequency = _column([p.frequency_penalty for p in params], device)
        self.presence = _column([p.presence_penalty for p in params], device)
        self.uses_frequency = any(p.frequency_penalty != 0.0 for p in params)
        self.uses_presence = any(p.presence_penalty != 0.0 for p in params)
        shape = (len(rows), vocab_size)
        self.output_counts = torch.zeros(shape, dtype=torch.float32, device=device)
        #: Tokens of the prompt or the output, for rows with a repetition penalty (other
        #: rows stay empty: a penalty of 1 changes nothing). None if no row has one.
        self.seen = (torch.zeros(shape, dtype=torch.bool, device=device)
                     if any(p.repetition_penalty != 1.0 for p in params) else None)
        #: Output tokens already counted, per row.
        self._counted = [0] * len(rows)
        self._take_over(previous)

    def _take_over(self, previous: PenaltyState | None) -> None:
        """Copy the rows of sequences ``previous`` already counted. Other rows start at
        zero: their prompts are marked here, their outputs counted by :meth:`update`."""
        old_rows: dict[int, int] = {}
        if previous is not None and previous.vocab_size == self.vocab_size \
                and (self.seen is None or previous.seen is not None):
            old_rows = {s.seq_id: i for i, s in enumerate(previous.seqs)}
        # a row is taken over only from the row that held the very same output list: a
        # draft row (speculative decoding) holds a new list of tokens not yet accepted
        kept = [(i, j) for i, s in enumerate(self.seqs)
                if (j := old_rows.get(s.seq_id)) is not None
                and previous is not None
                and previous.seqs[j].output_token_ids is s.output_token_ids]
        if previous is not None and kept:
            dst = torch.tensor([i for i, _ in kept], device=self.rows.device)
            src = torch.tensor([j for _, j in kept], device=self.rows.device)
            self.output_counts.index_copy_(0, dst, previous.output_counts.index_select(0, src))
            if self.seen is not None and previous.seen is not None:
                self.seen.index_copy_(0, dst, previous.seen.index_select(0, src))
            for i, j in kept:
                self._counted[i] = previous._counted[j]
        if self.seen is not None:
            taken = {i for i, _ in kept}
            fresh = [i for i, s in enumerate(self.seqs)
                     if i not in taken and s.params.repetition_penalty != 1.0]
            self._mark(fresh, [self.seqs[i].prompt_token_ids for i in fresh])

    def update(self) -> None:
        """Count the output tokens appended since the last call (or since creation)."""
        rows, tokens = [], []
        for i, seq in enumerate(self.seqs):
            out = seq.output_token_ids
            if len(out) != self._counted[i]:
                if len(out) < self._counted[i]:
                    raise RuntimeError(f"sequence {seq.seq_id} lost output tokens "
                                       f"({len(out)} < {self._counted[i]} counted)")
                rows.append(i)
                tokens.append(out[self._counted[i]:])
                self._counted[i] = len(out)
        if not rows:
            return
        index = self._flat_index(rows, tokens)
        self.output_counts.view(-1).scatter_add_(
            0, index, torch.ones(index.shape, dtype=torch.float32, device=index.device))
        if self.seen is not None:
            self.seen.view(-1)[index] = True

    def apply(self, logits: torch.Tensor) -> None:
        """Penalise ``logits`` [N, V] (the whole batch) in place."""
        x = logits if self.all_rows else logits[self.rows]  # a view, or a copy
        counts = self.output_counts
        if self.seen is not None:  # some row has a repetition penalty
            # clamp/div/mul instead of where() over broadcast penalties: ~3x faster on CPU.
            r = self.repetition
            penalised = x.clamp(min=0).div_(r).add_(x.clamp(max=0).mul_(r))
            x.copy_(torch.where(self.seen, penalised, x))
        if self.uses_frequency:
            x.addcmul_(counts, self.frequency, value=-1.0)
        if self.uses_presence:
            x.addcmul_(counts.sign(), self.presence, value=-1.0)
        if not self.all_rows:
            logits[self.rows] = x

    def _mark(self, rows: list[int], tokens: list[list[int]]) -> None:
        if self.seen is not None and rows:
            self.seen.view(-1)[self._flat_index(rows, tokens)] = True

    def _flat_index(self, rows: list[int], tokens: list[list[int]]) -> torch.Tensor:
        """Row-major positions of (row, token) pairs in a [P, V] tensor: each row index
        repeated once per token, without a Python loop over the tokens."""
        flat = torch.tensor(list(itertools.chain.from_iterable(tokens)), dtype=torch.long)
        row_ids = torch.repeat_interleave(torch.tensor(rows, dtype=torch.long),
                                          torch.tensor([len(t) for t in tokens]))
        return (row_ids * self.vocab_size + flat).to(self.output_counts.device)


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)
