"""Paged attention on Gaudi: FusedSDPA for prefill, a flat block-table decode.

Written against the Gaudi bridge docs (``habana_frameworks.torch.hpex.kernels.FusedSDPA``),
NOT run on a Gaudi. Per step the rows split as in the core's reference backend (whose
grouping, layout and ``write_kv`` this backend reuses: they are plain torch ops, which
the HPU runs as they are):

- *prefill* rows (sequences with several new tokens): their pages are gathered into a
  padded dense batch and handed to FusedSDPA with an additive mask (causal from each
  row's position, the window, the sequence's end). GQA folds the ``G`` query heads of a
  KV head into the query axis, ``[b, Hkv, G * q, D]``, so K/V are never repeated.
- *decode* rows (one new token each): the flat formulation. All their pages are listed
  once (``block_list``, with ``block_groups`` naming each page's sequence), gathered with
  ``index_select`` and scored with one batched matmul per page; a per-slot mask removes
  positions past the end or outside the window; the softmax is taken across each
  sequence's pages through a per-sequence max and sum (``scatter_reduce_`` /
  ``index_add_``). No padding to the longest sequence, so shapes depend on the number of
  pages, not on the length of the longest one.
- a soft cap, which FusedSDPA does not take: the reference's own attention.

Unwritten slots may hold anything, NaN included: gathered K and V are zeroed outside
each sequence before any product, since a -inf mask or a zero weight does not cancel NaN.

Layout: the reference's, ``[2, num_blocks, block_size, Hkv, D]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from quire.interfaces.attention import AttentionBackend, AttentionBatch, check_attention_options
from quire.ops.attention import ReferenceAttentionBackend, ReferenceAttentionMetadata


@dataclass(frozen=True)
class FlatDecode:
    """The decode rows' pages, listed flat (see the module doc)."""

    #: int64 [b]: rows of the flat batch that are decode tokens.
    token_idx: torch.Tensor
    #: int64 [NB]: every page any decode sequence reads, sequence after sequence.
    block_list: torch.Tensor
    #: int64 [NB]: which of the b decode sequences each page belongs to.
    block_groups: torch.Tensor
    #: int64 [NB, block_size]: the token position each slot of each page holds.
    positions: torch.Tensor
    #: int64 [b]: each decode token's own position (its sequence's length - 1).
    last_pos: torch.Tensor


@dataclass(frozen=True)
class GaudiMetadata:
    #: The reference's grouping: the prefill group feeds FusedSDPA, all groups the
    #: soft-cap path.
    reference: ReferenceAttentionMetadata
    decode: FlatDecode | None


class GaudiAttentionBackend(AttentionBackend):
    """FusedSDPA prefill and flat decode; GQA by head index ``h // G`` (Hugging Face)."""

    name = "gaudi"

    def __init__(self, fused_sdpa: Any) -> None:
        #: ``habana_frameworks.torch.hpex.kernels.FusedSDPA``, passed in so that importing
        #: this module imports no vendor code.
        self._fsdpa = fused_sdpa
        self._reference = ReferenceAttentionBackend()

    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return self._reference.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)

    def build_metadata(self, batch: AttentionBatch) -> GaudiMetadata:
        return GaudiMetadata(self._reference.build_metadata(batch), _flat_decode(batch))

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
        metadata: GaudiMetadata,
    ) -> None:
        self._reference.write_kv(key, value, kv_cache, metadata.reference)

    def attend(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: GaudiMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        check_attention_options(sliding_window, logits_soft_cap)
        if logits_soft_cap is not None:
            return self._reference.attend(query, kv_cache, metadata.reference, scale=scale,
                                          sliding_window=sliding_window,
                                          logits_soft_cap=logits_soft_cap)
        out = query.new_empty(query.shape)
        for group in metadata.reference.groups:
            if group.max_q > 1:
                rows = self._prefill(query, kv_cache, group, scale, sliding_window)
                out.index_copy_(0, group.token_idx, rows.to(query.dtype))
        if metadata.decode is not None:
            rows = _decode(query, kv_cache, metadata.decode, scale, sliding_window)
            out.index_copy_(0, metadata.decode.token_idx, rows.to(query.dtype))
        return out

    def _prefill(self, query: torch.Tensor, kv_cache: torch.Tensor, group: Any, scale: float,
                 sliding_window: int | None) -> torch.Tensor:
        """FusedSDPA over one padded group (the reference's ``_Group``); rows in flat order."""
        b, max_q = group.num_seqs, group.max_q
        hkv, (hq, d) = kv_cache.shape[3], query.shape[1:]
        g = hq // hkv
        keys = kv_cache[0][group.block_tables].flatten(1, 2)  # [b, L, Hkv, D], a copy
        values = kv_cache[1][group.block_tables].flatten(1, 2)
        keys.masked_fill_(~group.kv_valid, 0.0)
        values.masked_fill_(~group.kv_valid, 0.0)
        mask = group.causal_mask  # [b, max_q, L]
        if sliding_window is not None:
            j = torch.arange(mask.shape[-1], device=mask.device)
            mask = mask & (j[None, None, :] > group.q_pos[:, :, None] - sliding_window)
        q = query.new_zeros(b * max_q, hq, d)
        q.index_copy_(0, group.padded_idx, query.index_select(0, group.token_idx))
        q = q.view(b, max_q, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * max_q, d)
        bias = torch.zeros(b, 1, 1, max_q, mask.shape[-1], dtype=query.dtype,
                           device=query.device)
        bias.masked_fill_(~mask[:, None, None], float("-inf"))
        bias = bias.expand(b, 1, g, max_q, -1).reshape(b, 1, g * max_q, -1)
        # positional: query, key, value, attn_mask, dropout_p, is_causal, scale
        out = self._fsdpa.apply(q, keys.transpose(1, 2), values.transpose(1, 2), bias, 0.0,
                                False, scale)
        out = out.view(b, hkv, g, max_q, d).permute(0, 3, 1, 2, 4).reshape(b * max_q, hq, d)
        return out.index_select(0, group.padded_idx)


def _flat_decode(batch: AttentionBatch) -> FlatDecode | None:
    """The decode sequences' pages, listed flat; None when the step has no decode row."""
    device = batch.seq_lens.device
    is_decode = torch.tensor(batch.query_lens, dtype=torch.int64) == 1
    seqs = torch.nonzero(is_decode).squeeze(1).to(device)
    if seqs.numel() == 0:
        return None
    bs = batch.block_size
    seq_lens = batch.seq_lens[seqs].long()
    width = batch.block_tables.shape[1]
    col = torch.arange(width, device=device)
    keep = col[None, :] < ((seq_lens + bs - 1) // bs)[:, None]  # [b, width]: pages in use
    b = int(seqs.numel())
    return FlatDecode(
        token_idx=batch.query_start_loc[seqs].long(),
        block_list=batch.block_tables[seqs].long()[keep],
        block_groups=torch.arange(b, device=device)[:, None].expand(b, width)[keep],
        positions=col.expand(b, width)[keep][:, None] * bs + torch.arange(bs, device=device),
        last_pos=seq_lens - 1,
    )


def _decode(query: torch.Tensor, kv_cache: torch.Tensor, flat: FlatDecode, scale: float,
            sliding_window: int | None) -> torch.Tensor:
    """Flat paged attention of the decode rows, float32; rows in ``flat.token_idx`` order."""
    hkv, (hq, d) = kv_cache.shape[3], query.shape[1:]
    g, b = hq // hkv, int(flat.last_pos.shape[0])
    keys = kv_cache[0].index_select(0, flat.block_list).float()  # [NB, bs, Hkv, D]
    values = kv_cache[1].index_select(0, flat.block_list).float()
    last = flat.last_pos[flat.block_groups][:, None]  # [NB, 1]
    valid = flat.positions <= last  # [NB, bs]
    if sliding_window is not None:
        valid &= flat.positions > last - sliding_window
    values.masked_fill_(~valid[:, :, None, None], 0.0)
    q = query.index_select(0, flat.token_idx).float().view(b, hkv, g, d)[flat.block_groups]
    scores = torch.einsum("nkgd,nskd->nkgs", q, keys).mul_(scale)  # [NB, Hkv, G, bs]
    scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
    # softmax across each sequence's pages: its max, then its sum
    block_max = scores.amax(-1)  # [NB, Hkv, G]
    index = flat.block_groups[:, None, None].expand_as(block_max)
    seq_max = block_max.new_full((b, hkv, g), float("-inf"))
    seq_max.scatter_reduce_(0, index, block_max, "amax")
    weights = torch.exp(scores - seq_max[flat.block_groups][..., None])
    sums = scores.new_zeros(b, hkv, g).index_add_(0, flat.block_groups, weights.sum(-1))
    out = scores.new_zeros(b, hkv, g, d)
    out.index_add_(0, flat.block_groups, torch.einsum("nkgs,nskd->nkgd", weights, values))
    return (out / sums[..., None]).reshape(b, hq, d)
