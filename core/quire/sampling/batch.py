"""Per-row sampling parameters of one batch composition, as tensors.

A composition is the sequences of a step in row order together with their
``SamplingParams`` objects (:func:`batch_key`). :class:`BatchParams` is built once per
composition and reused while it does not change; only what moves every step -- the
output token counts (in :class:`~quire.sampling.penalties.PenaltyState`) and which rows
are still under ``min_tokens`` -- is recomputed per step.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass
from operator import attrgetter

import torch

from quire.sampling.logprobs import resolve_k
from quire.sampling.penalties import PenaltyState, uses_penalties
from quire.sampling.rows import SamplingRow

_NEG_INF = float("-inf")
_seq_id, _params = attrgetter("seq_id"), attrgetter("params")


def batch_key(seqs: list[SamplingRow], device: torch.device) -> Hashable:
    """What identifies a composition. ``id(params)`` is stable while the sequence (which
    holds its params) lives, and sequence ids are never reused."""
    # per step: map over C getters, not generator expressions
    return device, tuple(map(_seq_id, seqs)), tuple(map(id, map(_params, seqs)))


@dataclass
class RandomRows:
    """The rows that sample (temperature > 0); tensors are indexed by position in ``rows``."""

    rows: torch.Tensor  # int64 [R], batch row of each
    all_rows: bool
    temperature: torch.Tensor  # float32 [R, 1]
    log_min_p: torch.Tensor | None  # float32 [R, 1]; None when no row uses min-p
    top_k: torch.Tensor | None  # int64 [R], V when off; None when no row uses top-k
    top_k_max: int
    top_p: torch.Tensor | None  # float32 [R, 1], inf when off; None when no row uses it
    seeded: list[tuple[int, int, int]]  # (position, seq_id, seed)
    unseeded: torch.Tensor | None  # int64 positions drawn from the engine's generator


@dataclass
class MinTokens:
    """The (row, token) pairs to mask while a row has fewer than ``min_tokens`` outputs."""

    seqs: list[SamplingRow]  # rows with min_tokens > 0
    min_tokens: list[int]
    pair_rows: torch.Tensor  # int64, batch row of each pair
    pair_cols: torch.Tensor  # int64, token id of each pair
    pair_owner: torch.Tensor  # int64, index into ``seqs`` of each pair

    def apply(self, logits: torch.Tensor) -> None:
        """Mask EOS and stop tokens of the rows still short of ``min_tokens``, in place."""
        short = [len(s.output_token_ids) < m for s, m in zip(self.seqs, self.min_tokens)]
        if not any(short):
            return
        active = torch.tensor(short, device=self.pair_owner.device)[self.pair_owner]
        logits[self.pair_rows[active], self.pair_cols[active]] = _NEG_INF


@dataclass
class LogprobRows:
    """The rows that asked for logprobs."""

    rows: list[int]
    index: torch.Tensor  # int64 [L], the same rows as a tensor
    ks: list[int]  # alternatives per row, resolved (-1 -> V)


@dataclass
class BatchParams:
    """Everything the sampler needs about one composition, as tensors on its device."""

    key: Hashable
    num_rows: int
    greedy_rows: torch.Tensor | None  # int64; None when no row is greedy
    random: RandomRows | None  # None when every row is greedy
    #: (rows, token ids, values) added to the logits; None when no row has a bias.
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    min_tokens: MinTokens | None
    penalties: PenaltyState | None
    logprobs: LogprobRows | None
    #: Rows with ``allowed_token_ids`` and their masks (True where a token is allowed).
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None
    #: ``(row, owner)`` of rows with bad words (their bans change every step).
    bad_words: list[tuple[int, SamplingRow]] | None = None
    #: ``(row, owner)`` of rows with logits processors.
    processors: list[tuple[int, SamplingRow]] | None = None

    @classmethod
    def build(cls, seqs: list[SamplingRow], vocab_size: int, eos_token_ids: frozenset[int],
              device: torch.device, previous: BatchParams | None) -> BatchParams:
        """:param previous: the last composition's params; its penalty counts are reused
            for sequences in both.
        :raises ValueError: a ``logit_bias`` token id outside the vocabulary."""
        greedy = [i for i, s in enumerate(seqs) if s.params.temperature == 0.0]
        penalised = [i for i, s in enumerate(seqs) if uses_penalties(s)]
        return cls(
            key=batch_key(seqs, device),
            num_rows=len(seqs),
            greedy_rows=_index(greedy, device) if greedy else None,
            random=_random_rows(seqs, vocab_size, device),
            bias=_bias(seqs, vocab_size, device),
            min_tokens=_min_tokens(seqs, vocab_size, eos_token_ids, device),
            penalties=(PenaltyState(seqs, penalised, vocab_size, device,
                                    previous.penalties if previous else None)
                       if penalised else None),
            logprobs=_logprob_rows(seqs, vocab_size, device),
            allowed=_allowed(seqs, vocab_size, device),
            bad_words=[(i, s) for i, s in enumerate(seqs)
                       if s.params.bad_words_token_ids] or None,
            processors=[(i, s) for i, s in enumerate(seqs)
                        if s.params.logits_processors] or None,
        )


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)


def _random_rows(seqs: list[SamplingRow], vocab_size: int,
                 device: torch.device) -> RandomRows | None:
    rows = [i for i, s in enumerate(seqs) if s.params.temperature > 0.0]
    if not rows:
        return None
    params = [seqs[i].params for i in rows]
    ks = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params]
    k_on = [k for k in ks if k < vocab_size]
    seeded = [(pos, seqs[i].seq_id, p.seed) for pos, (i, p) in enumerate(zip(rows, params))
              if p.seed is not None]
    unseeded = [pos for pos, p in enumerate(params) if p.seed is None]
    return RandomRows(
        rows=_index(rows, device),
        all_rows=len(rows) == len(seqs),
        temperature=_column([p.temperature for p in params], device),
        log_min_p=(_column([math.log(p.min_p) if p.min_p > 0 else _NEG_INF
                            for p in params], device)
                   if any(p.min_p > 0 for p in params) else None),
        top_k=_index(ks, device) if k_on else None,
        top_k_max=max(k_on, default=vocab_size),
        top_p=(_column([p.top_p if p.top_p < 1.0 else math.inf for p in params], device)
               if any(p.top_p < 1.0 for p in params) else None),
        seeded=seeded,
        unseeded=_index(unseeded, device) if unseeded else None,
    )


def _bias(seqs: list[SamplingRow], vocab_size: int,
          device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for i, seq in enumerate(seqs):
        bias = seq.params.logit_bias
        if not bias:
            continue
        bad = [t for t in bias if t >= vocab_size]
        if bad:
            raise ValueError(f"sequence {seq.seq_id}: logit_bias token id {bad[0]} is "
                             f"outside the vocabulary [0, {vocab_size})")
        rows += [i] * len(bias)
        cols += bias.keys()
        values += bias.values()
    if not rows:
        return None
    return _index(rows, device), _index(cols, device), \
        torch.tensor(values, dtype=torch.float32, device=device)


def _min_tokens(seqs: list[SamplingRow], vocab_size: int, eos_token_ids: frozenset[int],
                device: torch.device) -> MinTokens | None:
    owners: list[SamplingRow] = []
    minimums: list[int] = []
    rows: list[int] = []
    cols: list[int] = []
    owner_of_pair: list[int] = []
    for i, seq in enumerate(seqs):
        if seq.params.min_tokens == 0:
            continue
        # EOS is masked even with ignore_eos, as in vLLM; ids past the logits can never
        # be sampled, so they need no mask.
        stop = sorted(t for t in eos_token_ids.union(seq.params.stop_token_ids or ())
                      if t < vocab_size)
        if not stop:
            continue
        owner_of_pair += [len(owners)] * len(stop)
        owners.append(seq)
        minimums.append(seq.params.min_tokens)
        rows += [i] * len(stop)
        cols += stop
    if not owners:
        return None
    return MinTokens(owners, minimums, _index(rows, device), _index(cols, device),
                     _index(owner_of_pair, device))


def _allowed(seqs: list[SamplingRow], vocab_size: int,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    rows = [i for i, s in enumerate(seqs) if s.params.allowed_token_ids]
    if not rows:
        return None
    mask = torch.zeros(len(rows), vocab_size, dtype=torch.bool)
    for j, i in enumerate(rows):
        ids = [t for t in seqs[i].params.allowed_token_ids if t < vocab_size]  # type: ignore[union-attr]
        if not ids:
            raise ValueError(f"sequence {seqs[i].seq_id}: no allowed_token_ids inside the "
                             f"vocabulary [0, {vocab_size})")
        mask[j, ids] = True
    return _index(rows, device), mask.to(device)


def _logprob_rows(seqs: list[SamplingRow], vocab_size: int,
                  device: torch.device) -> LogprobRows | None:
    rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    if not rows:
        return None
    ks = [resolve_k(seqs[i].params.logprobs, vocab_size) for i in rows]  # type: ignore[arg-type]
    return LogprobRows(rows, _index(rows, device), ks)
