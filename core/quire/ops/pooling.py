"""The reference ops of embedding models: pooling a sequence's hidden states into one
vector, and bidirectional attention within each sequence of a flattened batch.

An encoder (BERT) computes a whole prompt in one step and keeps no K/V, so its attention
needs no pages: every token of a sequence sees every other token of that sequence, and
nothing of the other sequences batched with it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

#: The pooling methods :func:`pool` knows (sentence-transformers' names where it has one).
POOLING_METHODS = ("mean", "cls", "last")


def pool(hidden: torch.Tensor, query_start_loc: torch.Tensor, method: str,
         normalize: bool) -> torch.Tensor:
    """One float32 vector per sequence of a flattened batch.

    ``mean``: the average of the sequence's rows (sentence-transformers' mean pooling,
    every token counted); ``cls``: its first row; ``last``: its last row (decoder
    embedding models). With ``normalize``, each vector is scaled to unit L2 norm.

    :param hidden: [T, H] hidden states, sequence ``i`` in rows
        ``query_start_loc[i]:query_start_loc[i+1]`` (each sequence at least one row).
    :param query_start_loc: int64 [B+1] prefix sums of the sequences' lengths.
    :returns: float32 [B, H].
    :raises ValueError: for an unknown ``method``.
    """
    starts, ends = query_start_loc[:-1], query_start_loc[1:]
    if method == "cls":
        pooled = hidden[starts].float()
    elif method == "last":
        pooled = hidden[ends - 1].float()
    elif method == "mean":
        lengths = ends - starts
        owner = torch.repeat_interleave(torch.arange(len(lengths), device=hidden.device),
                                        lengths)
        sums = torch.zeros(len(lengths), hidden.shape[1], dtype=torch.float32,
                           device=hidden.device)
        sums.index_add_(0, owner, hidden.float())
        pooled = sums / lengths.unsqueeze(1).to(torch.float32)
    else:
        raise ValueError(f"pooling method must be one of {', '.join(POOLING_METHODS)}, "
                         f"got {method!r}")
    return F.normalize(pooled, p=2.0, dim=-1) if normalize else pooled


def bidirectional_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            query_start_loc: torch.Tensor, query_lens: Sequence[int], *,
                            scale: float) -> torch.Tensor:
    """Non-causal attention within each sequence of a flattened batch, no KV cache.

    :param query: [T, H, D]; ``key``/``value``: [T, H, D] (as many heads as the query).
    :param query_start_loc: int64 [B+1] on the device, prefix sums of the lengths (what
        a varlen kernel takes; the reference splits by ``query_lens``).
    :param query_lens: host-side length of each sequence (they sum to T), in row order.
    :returns: [T, H, D]: row ``t`` attends over every row of its own sequence.
    """
    out = []
    for q, k, v in zip(query.split(list(query_lens)), key.split(list(query_lens)),
                       value.split(list(query_lens))):
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                           v.transpose(0, 1), scale=scale)
        out.append(o.transpose(0, 1))
    return torch.cat(out) if len(out) > 1 else out[0].contiguous()
