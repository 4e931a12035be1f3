"""Speculative decoding's verification step: the rejection-sampling rule, batched.

A drafter proposes tokens d_0..d_{k-1}, draft j drawn from a distribution q_j; the
target model scores the context plus every draft in one pass, which gives p_0..p_k
(p_j: the next token after the context and d_0..d_{j-1}). Walking j = 0, 1, ...:

| request | accept d_j when | at the first rejection, emit | all k accepted: emit |
| --- | --- | --- | --- |
| greedy | ``d_j == argmax p_j`` | ``argmax p_j`` | ``argmax p_k`` |
| random | ``u_j * q_j(d_j) < p_j(d_j)`` | a sample of ``max(0, p_j - q_j)`` | a sample of p_k |

Why the random rule keeps the target distribution exactly (Leviathan et al. 2023, Chen
et al. 2023): token x comes out at position j either as an accepted draft, with
probability ``q(x) * min(1, p(x) / q(x)) = min(p(x), q(x))``, or after a rejection, which
happens with probability ``1 - sum_y min(p(y), q(y)) = sum_y max(0, p(y) - q(y))`` and is
followed by x with probability ``max(0, p(x) - q(x))`` over that same sum. The two add up
to ``min(p, q) + max(0, p - q) = p(x)``. Each position then conditions on the tokens
before it, so the whole sequence is distributed as the target model would sample it.

- ``u * q < p`` is vLLM's form of ``u < p / q``: no division, and a draft that q gave 0
  is accepted whenever p allows it.
- ``draft_probs=None`` means q is one-hot on the draft (n-gram and greedy drafters): the
  draft is accepted with probability p(d), else p without d is sampled; that is p again,
  whichever way d was chosen.
- Samples are exponential races, ``argmax(r / noise)`` with the caller's Exponential(1)
  noise, as :mod:`quire.sampler` draws them. The race needs no normalised ``r``. A
  residual that sums to 0 (rounding only) falls back to p.
- A sequence without drafts has only its bonus row, so it gets ``argmax(p / noise)``
  bit for bit: a step with no drafts is the sampler's own step.
"""

from __future__ import annotations

import torch

from quire.sampling.argmax import row_argmax


def verify(target_probs: torch.Tensor, draft_token_ids: list[list[int]],
           draft_probs: torch.Tensor | None, greedy: torch.Tensor,
           uniforms: torch.Tensor, noise: torch.Tensor) -> tuple[list[list[int]], list[int]]:
    """Accept a prefix of each sequence's drafts and emit one token after it.

    Sequence s with k_s drafts owns k_s + 1 consecutive rows of every per-row input, in
    sequence order (R rows in all): row j is the position of draft j, row k_s the bonus.

    :param target_probs: float [R, V], the target's probabilities after every sampling
        parameter (masked tokens 0).
    :param draft_token_ids: the drafts of each sequence; len(draft_token_ids[s]) = k_s.
    :param draft_probs: float [R, V], the q_j that proposed draft j (bonus rows are not
        read); None when each draft is deterministic (q one-hot on the draft).
    :param greedy: bool [R], rows of greedy requests; those never read uniforms or noise.
    :param uniforms: float [R] in [0, 1), one draw per row (the acceptance test).
    :param noise: float [R, V], strictly positive Exponential(1) draws (the race).
    :returns: ``(tokens, accepted)``: tokens[s] is the accepted drafts then one emitted
        token; accepted[s] the number of drafts accepted (0..k_s).
    :raises ValueError: a shape, dtype, device or draft id that does not fit the layout.
    """
    lengths = [len(drafts) for drafts in draft_token_ids]
    # the bonus row takes a placeholder draft (0): its test is masked out below
    flat = [token for drafts in draft_token_ids for token in (*drafts, 0)]
    _check_inputs(target_probs, flat, lengths, draft_probs, greedy, uniforms, noise)
    if not lengths:
        return [], []
    device = target_probs.device
    num_rows = len(flat)
    rows_per_seq = torch.tensor([k + 1 for k in lengths], device=device)
    starts = rows_per_seq.cumsum(0) - rows_per_seq
    seq_of_row = torch.repeat_interleave(torch.arange(len(lengths), device=device),
                                         rows_per_seq, output_size=num_rows)
    pos = torch.arange(num_rows, device=device) - starts[seq_of_row]
    is_bonus = pos == rows_per_seq[seq_of_row] - 1
    drafts = torch.tensor(flat, dtype=torch.int64, device=device)

    # accept test, every row at once
    target_top = row_argmax(target_probs)
    p_draft = target_probs.gather(1, drafts[:, None]).squeeze(1)
    q_draft = (torch.ones_like(p_draft) if draft_probs is None
               else draft_probs.gather(1, drafts[:, None]).squeeze(1))
    accept = torch.where(greedy, drafts == target_top, uniforms * q_draft < p_draft)
    accept &= ~is_bonus
    # the first rejected row of each sequence (the bonus row at the latest)
    accepted = torch.full_like(starts, num_rows).scatter_reduce_(
        0, seq_of_row, pos.masked_fill(accept, num_rows), "amin")

    # the emitted token, on each sequence's first rejected row only
    emit = starts + accepted
    probs = target_probs[emit]
    residual = _residual(probs, None if draft_probs is None else draft_probs[emit],
                         drafts[emit])
    use_probs = is_bonus[emit] | (residual.sum(dim=-1) <= 0)
    residual = torch.where(use_probs[:, None], probs, residual)
    sampled = row_argmax(residual.div_(noise[emit]))
    token = torch.where(greedy[emit], target_top[emit], sampled)

    counts, emitted = torch.stack((accepted, token)).tolist()
    tokens = [[*drafts_s[:n], t] for drafts_s, n, t in zip(draft_token_ids, counts, emitted)]
    return tokens, counts


def _residual(probs: torch.Tensor, draft_probs: torch.Tensor | None,
              drafts: torch.Tensor) -> torch.Tensor:
    """``max(0, p - q)`` per row, unnormalised; q one-hot on the draft when None."""
    if draft_probs is None:
        return probs.scatter(1, drafts[:, None], 0.0)
    return (probs - draft_probs).clamp_(min=0.0)


def _check_inputs(target_probs: torch.Tensor, flat: list[int], lengths: list[int],
                  draft_probs: torch.Tensor | None, greedy: torch.Tensor,
                  uniforms: torch.Tensor, noise: torch.Tensor) -> None:
    """Raise ValueError naming the first input that does not fit the row layout."""
    if target_probs.dim() != 2:
        raise ValueError(f"target_probs must be [rows, vocab], got {tuple(target_probs.shape)}")
    rows, vocab = target_probs.shape
    if rows != len(flat):
        raise ValueError(f"target_probs has {rows} rows, but {len(lengths)} sequences with "
                         f"{sum(lengths)} drafts need {len(flat)} (k + 1 per sequence)")
    expected = {"noise": (noise, (rows, vocab)), "greedy": (greedy, (rows,)),
                "uniforms": (uniforms, (rows,))}
    if draft_probs is not None:
        expected["draft_probs"] = (draft_probs, (rows, vocab))
    for name, (tensor, shape) in expected.items():
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name} must have shape {shape} to match target_probs, "
                             f"got {tuple(tensor.shape)}")
        if tensor.device != target_probs.device:
            raise ValueError(f"{name} is on {tensor.device}, target_probs on "
                             f"{target_probs.device}")
    if greedy.dtype != torch.bool:
        raise ValueError(f"greedy must be a bool tensor, got {greedy.dtype}")
    if flat and (min(flat) < 0 or max(flat) >= vocab):
        raise ValueError(f"a draft token id lies outside the vocabulary [0, {vocab})")
