"""Truncation filters on a batch of temperature-scaled logits: min-p, top-k, top-p.

Each filter sets the logits of the tokens it drops to ``-inf``; each row has its own
setting. The order is vLLM v1's: min-p first, then top-k, then top-p on what top-k kept.
Every filter keeps the most likely token, so no row is ever left empty.
"""

from __future__ import annotations

import torch

_NEG_INF = float("-inf")


def apply_min_p(logits: torch.Tensor, log_min_p: torch.Tensor) -> None:
    """Drop tokens less likely than ``min_p`` times the row's most likely token. In place.

    :param logits: float32 [R, V].
    :param log_min_p: float32 [R, 1], ``log(min_p)``; ``-inf`` (min_p = 0) drops nothing.

    Done in log space -- ``p_i >= min_p * p_max`` iff ``l_i - l_max >= log(min_p)`` -- so
    no softmax is needed.
    """
    threshold = logits.amax(dim=-1, keepdim=True) + log_min_p
    logits.masked_fill_(logits < threshold, _NEG_INF)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_k_max: int,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """Keep each row's ``k`` largest logits, then the smallest head of what is left whose
    probability (renormalised) reaches ``p``.

    :param logits: float32 [R, V]; changed in place when only top-k is asked for.
    :param top_k: int64 [R] in [1, V], ``V`` for rows without top-k; or None (no row).
        Ties with the k-th largest value are kept (a value threshold, as in vLLM).
    :param top_k_max: the largest k among rows that use top-k (``< V`` unless none do).
    :param top_p: float32 [R, 1] in (0, 1], ``inf`` for rows without top-p; or None.
        A token is kept when the tokens more likely than it hold less than ``p``.
    :returns: the filtered logits (``logits`` itself, or a new tensor when top-p ran).
    """
    if top_p is None:
        if top_k is not None:
            _top_k_only(logits, top_k, top_k_max)
        return logits
    ordered, order = logits.sort(dim=-1, descending=True, stable=True)
    if top_k is not None:
        kth = ordered.gather(1, (top_k - 1).unsqueeze(1))
        ordered.masked_fill_(ordered < kth, _NEG_INF)
    probs = ordered.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1).sub_(probs)  # probability of the more likely tokens
    ordered.masked_fill_(mass_before >= top_p, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, ordered)


def _top_k_only(logits: torch.Tensor, top_k: torch.Tensor, top_k_max: int) -> None:
    # torch.topk of the largest k asked for is much cheaper than sorting whole rows.
    values = logits.topk(top_k_max, dim=-1).values
    kth = values.gather(1, (top_k.clamp(max=top_k_max) - 1).unsqueeze(1))
    kth.masked_fill_((top_k > top_k_max).unsqueeze(1), _NEG_INF)  # rows without top-k
    logits.masked_fill_(logits < kth, _NEG_INF)
