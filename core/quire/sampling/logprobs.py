"""Logprob facts for chosen tokens: their logprob, rank and the top alternatives.

Used for sampled tokens (``SamplingParams.logprobs``) and for prompt tokens
(``prompt_logprobs``). Both read the model's raw distribution: ``log_softmax`` of the
logits as the model gave them, before bias, penalties, temperature and filters (vLLM v1's
default ``logprobs_mode="raw_logprobs"``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenLogprobs:
    """Logprobs at one position."""

    #: The token that was sampled (or, for a prompt, the prompt's next token).
    token_id: int
    #: Its logprob under the raw distribution.
    logprob: float
    #: 1-based; the number of tokens at least as likely as it (ties count against it,
    #: as in vLLM), so the most likely token has rank 1.
    rank: int
    #: The ``k`` most likely tokens as (token id, logprob), most likely first. May or may
    #: not include ``token_id``.
    top: list[tuple[int, float]]


def resolve_k(k: int, vocab_size: int) -> int:
    """The number of alternatives to return: -1 means the whole vocabulary."""
    return vocab_size if k == -1 else min(k, vocab_size)


def gather_token_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor,
                          ks: list[int]) -> list[TokenLogprobs]:
    """Per row: the logprob of ``token_ids[i]``, its rank and the top ``ks[i]``.

    :param logprobs: float32 [R, V], each row a log_softmax.
    :param token_ids: int64 [R] on the same device.
    :param ks: R counts, each in [0, V] (already resolved with :func:`resolve_k`).
    """
    return token_logprobs_of(token_logprob_tensors(logprobs, token_ids, max(ks, default=0)),
                             ks)


def token_logprob_tensors(logprobs: torch.Tensor, token_ids: torch.Tensor,
                          k_max: int) -> tuple[torch.Tensor, ...]:
    """:func:`gather_token_logprobs`' device half: the token ids [R], their logprobs [R],
    ranks [R], and the top ``k_max`` logprobs and ids [R, k_max], on the device."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    ranks = (logprobs >= chosen.unsqueeze(1)).sum(dim=-1)
    if k_max > 0:
        top_values, top_ids = logprobs.topk(k_max, dim=-1)
    else:
        top_values = logprobs.new_empty((logprobs.shape[0], 0))
        top_ids = token_ids.new_empty((logprobs.shape[0], 0))
    return token_ids, chosen, ranks, top_values, top_ids


def token_logprobs_of(tensors: tuple[torch.Tensor, ...], ks: list[int]) -> list[TokenLogprobs]:
    """:func:`gather_token_logprobs`' host half, from :func:`token_logprob_tensors`."""
    token_ids, chosen, ranks, top_values, top_ids = (t.tolist() for t in tensors)
    return [TokenLogprobs(tok, lp, rank, list(zip(ids[:k], values[:k])) if k else [])
            for tok, lp, rank, ids, values, k in zip(token_ids, chosen, ranks, top_ids,
                                                     top_values, ks)]


def compute_prompt_logprobs(logits: torch.Tensor, target_ids: torch.Tensor, k: int,
                            chunk_rows: int = 512) -> list[TokenLogprobs]:
    """Logprobs of prompt tokens: row ``i`` of ``logits`` is the model's prediction for
    ``target_ids[i]`` (so for a prompt ``t_0..t_{P}``, pass the logits of positions
    ``0..P-1`` and targets ``t_1..t_P``; the first prompt token has no logprob, which
    the engine reports as None, as vLLM does).

    :param logits: [P, V] raw model logits (any float dtype; computed in float32).
    :param target_ids: int [P].
    :param k: alternatives per position, >= 0, or -1 for the whole vocabulary.
    :param chunk_rows: rows converted to float32 logprobs at a time, to bound the
        memory used to ``chunk_rows * V`` floats.
    :returns: P entries, in order.
    """
    if logits.dim() != 2 or target_ids.shape != (logits.shape[0],):
        raise ValueError(f"logits must be [P, V] and target_ids [P], got "
                         f"{tuple(logits.shape)} and {tuple(target_ids.shape)}")
    vocab = logits.shape[1]
    k = resolve_k(k, vocab)
    targets = target_ids.to(device=logits.device, dtype=torch.long)
    out: list[TokenLogprobs] = []
    for start in range(0, logits.shape[0], chunk_rows):
        rows = slice(start, start + chunk_rows)
        logprobs = torch.log_softmax(logits[rows].float(), dim=-1)
        out += gather_token_logprobs(logprobs, targets[rows], [k] * logprobs.shape[0])
    return out
