"""The reference paged-attention backend, in plain torch ops.

Every other backend is measured against this one, so it favours being obviously right
over being fast, while still doing no per-token or per-sequence Python work in the hot
path. One step's rows are split into at most two groups, each attended as one padded
batch:

- *decode*: sequences with one new token (``query_len == 1``), padded query length 1;
- *prefill*: sequences with several new tokens (a whole prompt, or a chunk after a
  cached prefix), padded to the longest query of the group.

Keeping decode rows apart stops a single long prompt from padding every decode row to
its length.

KV cache layout, one tensor per layer: ``[2, num_blocks, block_size, Hkv, D]``, where
index 0 holds keys and 1 holds values. ``slot = block * block_size + offset`` addresses
``kv_cache[:, block, offset]``. Quantised pages (int8, fp8) hold rows of ``D + D / 8``:
the values, then a float16 scale per 16 of them (:mod:`quire.ops.kv_quant`); they are
dequantised to float32 as they are gathered.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quire.interfaces.attention import (
    AttentionBackend,
    AttentionBatch,
    check_attention_options,
)
from quire.ops import kv_quant


@dataclass(frozen=True)
class _Group:
    """Index tensors that move one group's rows between flat and padded form."""

    #: int64 [Tg]: rows of the flat ``[T, ...]`` batch that belong to this group.
    token_idx: torch.Tensor
    #: int64 [Tg]: the same rows' positions in the group's ``[b * max_q]`` padded rows.
    padded_idx: torch.Tensor
    #: int64 [b, n_blocks]: the group's block tables, cut to the blocks any of it reads.
    block_tables: torch.Tensor
    #: int64 [b, max_q]: position of each padded query row in its sequence. Padding rows
    #: repeat the last real position, so no row is fully masked (no NaN to hide).
    q_pos: torch.Tensor
    #: bool [b, max_q, L]: key ``j`` is inside the sequence and not in the future of the
    #: row (``j < seq_len`` and ``j <= p``); the sliding window is applied per layer.
    causal_mask: torch.Tensor
    #: bool [b, L, 1, 1]: slot ``j`` holds one of the sequence's tokens (``j < seq_len``).
    #: Slots past the end were never written for this sequence and may hold anything,
    #: NaN included, which a zero probability would not cancel (0 * NaN = NaN).
    kv_valid: torch.Tensor
    num_seqs: int
    max_q: int


@dataclass(frozen=True)
class ReferenceAttentionMetadata:
    """One step's precomputed indices; shared by every layer of that step."""

    #: int64 [T]: where each new token's K/V goes.
    slot_mapping: torch.Tensor
    #: The non-empty groups (decode first, then prefill); at most two.
    groups: tuple[_Group, ...]


class ReferenceAttentionBackend(AttentionBackend):
    """Paged attention by gathering pages into a padded dense batch.

    Scores and softmax are computed in float32 whatever the cache dtype; the result is
    cast back to the query's dtype. GQA follows the Hugging Face convention: query head
    ``h`` reads KV head ``h // (Hq // Hkv)``.
    """

    name = "cpu-reference"
    kv_cache_dtypes = ("float32", "bfloat16", "int8", "fp8")
    kv_int8_hadamard = True

    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    def build_metadata(self, batch: AttentionBatch) -> ReferenceAttentionMetadata:
        """Split the batch into decode and prefill groups and build their indices.

        Works from the host-side ``query_lens`` and ``max_seq_len`` so sizes need no sync.

        :raises ValueError: when ``block_tables`` has fewer columns than the longest
            sequence needs, or ``query_lens`` disagrees with the number of tokens.
        """
        if sum(batch.query_lens) != batch.num_tokens:
            raise ValueError(
                f"query_lens sum to {sum(batch.query_lens)} but slot_mapping holds "
                f"{batch.num_tokens} tokens"
            )
        n_blocks = -(-batch.max_seq_len // batch.block_size)  # only what the longest needs
        if n_blocks > batch.block_tables.shape[1]:
            raise ValueError(
                f"block_tables has {batch.block_tables.shape[1]} columns but a sequence of "
                f"{batch.max_seq_len} tokens needs {n_blocks} blocks of {batch.block_size}"
            )
        device = batch.seq_lens.device
        q_lens = torch.tensor(batch.query_lens, dtype=torch.int64)
        groups = []
        for members, max_q in (
            (q_lens == 1, 1),
            (q_lens > 1, max(batch.query_lens, default=0)),
        ):
            seq_idx = torch.nonzero(members).squeeze(1).to(device)
            if seq_idx.numel() > 0:
                groups.append(_build_group(batch, seq_idx, max_q, n_blocks))
        return ReferenceAttentionMetadata(
            slot_mapping=batch.slot_mapping.long(),
            groups=tuple(groups),
        )

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: ReferenceAttentionMetadata,
    ) -> None:
        if kv_quant.is_quantized(kv_cache):
            kv_quant.write_kv(kv_cache, metadata.slot_mapping, key, value)
            return
        # A view, never a copy: a copy would silently drop the write.
        slots = kv_cache.view(2, -1, *kv_cache.shape[3:])
        slots[0].index_copy_(0, metadata.slot_mapping, key.to(kv_cache.dtype))
        slots[1].index_copy_(0, metadata.slot_mapping, value.to(kv_cache.dtype))

    def attend(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: ReferenceAttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        check_attention_options(sliding_window, logits_soft_cap)
        out = query.new_empty(query.shape)
        for group in metadata.groups:
            rows = _attend_group(
                query, kv_cache, group, scale, sliding_window, logits_soft_cap
            )
            out.index_copy_(0, group.token_idx, rows.to(query.dtype))
        return out


def _build_group(
    batch: AttentionBatch, seq_idx: torch.Tensor, max_q: int, n_blocks: int
) -> _Group:
    """Indices for the sequences ``seq_idx``, padded to ``max_q`` query rows each."""
    b = int(seq_idx.numel())
    starts = batch.query_start_loc[seq_idx].long()  # [b]
    q_lens = batch.query_start_loc[seq_idx + 1].long() - starts  # [b]
    seq_lens = batch.seq_lens[seq_idx].long()  # [b]
    device = starts.device

    # Padded cell (s, r) holds flat row starts[s] + r when r < q_lens[s].
    r = torch.arange(max_q, device=device).expand(b, max_q)
    real = r < q_lens[:, None]
    flat_row = starts[:, None] + r
    cell = torch.arange(b * max_q, device=device).view(b, max_q)

    # p = seq_len - q_len + r: the new tokens are the last q_len of the sequence.
    last_row = torch.minimum(r, q_lens[:, None] - 1)
    q_pos = (seq_lens - q_lens)[:, None] + last_row

    j = torch.arange(n_blocks * batch.block_size, device=device)
    kv_valid = j[None, :] < seq_lens[:, None]
    causal_mask = kv_valid[:, None, :] & (j[None, None, :] <= q_pos[:, :, None])
    return _Group(
        token_idx=flat_row[real],
        padded_idx=cell[real],
        block_tables=batch.block_tables[seq_idx, :n_blocks].long(),
        q_pos=q_pos,
        causal_mask=causal_mask,
        kv_valid=kv_valid[:, :, None, None],
        num_seqs=b,
        max_q=max_q,
    )


def _attend_group(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    group: _Group,
    scale: float,
    sliding_window: int | None,
    logits_soft_cap: float | None,
) -> torch.Tensor:
    """Dense masked attention for one group; returns its rows in flat order, float32."""
    _, hq, d = query.shape
    hkv = kv_cache.shape[3]
    b, max_q = group.num_seqs, group.max_q

    # gather: [b, n_blocks, block_size, Hkv, D] -> [b, L, Hkv, D]
    keys = kv_cache[0][group.block_tables].flatten(1, 2)
    values = kv_cache[1][group.block_tables].flatten(1, 2)
    if kv_quant.is_quantized(kv_cache):  # rows of D + D / 8: values, then their scales
        keys, values = kv_quant.dequantize(keys), kv_quant.dequantize(values)
    else:
        keys, values = keys.float(), values.float()
    # indexing made a copy, so this never touches the cache
    values.masked_fill_(~group.kv_valid, 0.0)

    # scatter the group's queries into [b, max_q, Hq, D]; padding rows stay zero
    q = query.new_zeros(b * max_q, hq, d)
    q.index_copy_(0, group.padded_idx, query.index_select(0, group.token_idx))
    # GQA without copying K/V: split Hq into (Hkv, G) so head h = k * G + g reads kv head k
    q = q.float().view(b, max_q, hkv, hq // hkv, d)

    # Scores are the largest tensor here (b * Hq * max_q * L floats), so they are changed
    # in place: one such buffer plus the softmax's output at the peak.
    scores = torch.einsum("bqkgd,blkd->bkgql", q, keys)  # [b, Hkv, G, max_q, L]
    scores.mul_(scale)
    if logits_soft_cap is not None:  # cap * tanh(s / cap)
        scores.div_(logits_soft_cap).tanh_().mul_(logits_soft_cap)
    mask = group.causal_mask
    if sliding_window is not None:
        j = torch.arange(mask.shape[-1], device=mask.device)
        mask = mask & (j[None, None, :] > group.q_pos[:, :, None] - sliding_window)
    scores.masked_fill_(~mask[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)

    out = torch.einsum("bkgql,blkd->bqkgd", probs, values).reshape(b * max_q, hq, d)
    return out.index_select(0, group.padded_idx)
