"""Random paged-attention steps for the attention backends' tests.

A step is a list of sequences ``(cached, new)``: ``cached`` tokens already in the cache,
``new`` tokens arriving now. Their pages are a random permutation of a pool with spare
pages nobody owns, block-table columns past a sequence's last page hold random valid ids
(padding the contract says is never read), and the cached prefixes are written straight
into a cache of the layout every backend tested here uses, ``[2, num_blocks,
block_size, Hkv, D]``. Every other slot holds NaN, so a backend that reads a slot it was
not given shows NaN; or random values, for a reference that computes over its padding
and masks it afterwards. Nothing is zero.

(The conformance suite has its own builder, :mod:`quire.conformance.cases`, which writes
prefixes through the backend under test since a vendor's layout is unknown to it.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from quire.interfaces.attention import AttentionBatch


@dataclass
class PagedCase:
    batch: AttentionBatch
    query: torch.Tensor  # [T, Hq, D]
    key: torch.Tensor  # [T, Hkv, D]: the new tokens only
    value: torch.Tensor
    kv_cache: torch.Tensor  # prefixes written; see the module doc for the other slots
    full_keys: list[torch.Tensor]  # per sequence [S, Hkv, D]: prefix + new
    full_values: list[torch.Tensor]


def make_paged_case(
    seqs: list[tuple[int, int]],
    block_size: int,
    group: int,
    dtype: torch.dtype,
    *,
    num_kv_heads: int,
    head_size: int,
    seed: int = 0,
    layout_seed: int | None = None,
    unwritten: str = "nan",
) -> PagedCase:
    """Keys, values and queries drawn from ``seed``; page placement from ``layout_seed``
    (default: ``seed``), so that two cases can share a layout (two layers of one step).

    :param group: query heads per KV head.
    :param unwritten: what the slots no prefix wrote hold: ``"nan"`` or ``"random"``.
    """
    if unwritten not in ("nan", "random"):
        raise ValueError(f"unwritten must be 'nan' or 'random', got {unwritten!r}")
    gen = torch.Generator().manual_seed(seed)
    layout = torch.Generator().manual_seed(seed if layout_seed is None else layout_seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    seq_lens = [c + q for c, q in seqs]
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # spare pages nobody owns
    owners = torch.randperm(num_blocks, generator=layout).tolist()
    width = max(blocks_per_seq) + 1  # at least one padding column everywhere
    tables = torch.randint(0, num_blocks, (len(seqs), width), generator=layout)

    shape = (2, num_blocks, block_size, num_kv_heads, head_size)
    kv_cache = torch.full(shape, float("nan"), dtype=dtype) if unwritten == "nan" \
        else randn(*shape)
    flat = kv_cache.view(2, -1, num_kv_heads, head_size)
    keys, values, new_slots = [], [], []
    for i, ((cached, _), seq_len, n) in enumerate(zip(seqs, seq_lens, blocks_per_seq)):
        tables[i, :n] = torch.tensor(owners[:n])
        owners = owners[n:]
        pos = torch.arange(seq_len)
        slots = tables[i, pos // block_size] * block_size + pos % block_size
        k, v = randn(seq_len, num_kv_heads, head_size), randn(seq_len, num_kv_heads, head_size)
        flat[0, slots[:cached]], flat[1, slots[:cached]] = k[:cached], v[:cached]
        keys.append(k)
        values.append(v)
        new_slots.append(slots[cached:])

    query_lens = tuple(q for _, q in seqs)
    batch = AttentionBatch(
        slot_mapping=torch.cat(new_slots),
        query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()]),
        seq_lens=torch.tensor(seq_lens),
        block_tables=tables.to(torch.int32),
        block_size=block_size,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens=query_lens,
    )
    return PagedCase(
        batch=batch,
        query=randn(sum(query_lens), num_kv_heads * group, head_size),
        key=torch.cat([k[c:] for k, (c, _) in zip(keys, seqs)]),
        value=torch.cat([v[c:] for v, (c, _) in zip(values, seqs)]),
        kv_cache=kv_cache,
        full_keys=keys,
        full_values=values,
    )
