"""Random paged-attention cases, and running one on any backend whatever its KV layout.

A case is a batch of sequences, each ``(cached, new)``: ``cached`` tokens already in the
cache from earlier steps, ``new`` tokens arriving in this step. Everything random comes
from one seeded generator, and nothing is zero:

- queries, keys and values are N(0, 1), drawn in float32 and rounded to the dtype under
  test, so the reference sees exactly the values the backend sees;
- physical blocks are a random permutation, with spare blocks nobody owns, and block
  table entries past a sequence's last block are random valid ids (padding the contract
  says is never read);
- the cache is allocated by the backend and filled with NaN before anything is written,
  so a backend that reads a slot it was not given shows NaN in its output.

The cached prefix is written through the backend's own :meth:`write_kv` in an earlier
step, as the engine would, so the suite never needs to know a layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quire.interfaces.attention import AttentionBackend, AttentionBatch

#: KV heads in every case; query heads are this times the GQA group.
NUM_KV_HEADS = 2


def decode_shapes(block_size: int) -> list[tuple[int, int]]:
    """One new token each: a full block, one past it, two blocks on, a first token."""
    bs = block_size
    return [(max(bs - 1, 0), 1), (bs, 1), (2 * bs + 2, 1), (0, 1), (3, 1)]


def prefill_shapes(block_size: int) -> list[tuple[int, int]]:
    """Whole prompts crossing blocks, and a chunk after a cached prefix."""
    bs = block_size
    return [(0, bs + 3), (0, 2), (max(bs - 2, 0), 5), (0, 2 * bs)]


def mixed_shapes(block_size: int) -> list[tuple[int, int]]:
    """Decode and prefill rows interleaved in one step."""
    bs = block_size
    return [(0, bs + 3), (bs, 1), (max(bs - 2, 0), 5), (2 * bs + 1, 1), (0, 1), (3, bs)]


def verify_shapes(block_size: int) -> list[tuple[int, int]]:
    """Speculative decoding's verification: each sequence's last token and its drafts
    (1 + k query tokens) after a cached context, beside a plain decode."""
    bs = block_size
    return [(2 * bs + 1, 4), (max(bs - 1, 0), 2), (3 * bs, 6), (5, 1), (bs, 3)]


SHAPES = {"decode": decode_shapes, "prefill": prefill_shapes, "mixed": mixed_shapes,
          "verify": verify_shapes}


@dataclass(frozen=True)
class Case:
    """One step's inputs, on the host, in the dtype under test."""

    block_size: int
    num_blocks: int
    #: Writes the cached prefixes; None when no sequence has one.
    prefix_batch: AttentionBatch | None
    prefix_key: torch.Tensor  # [P, Hkv, D]
    prefix_value: torch.Tensor
    batch: AttentionBatch
    query: torch.Tensor  # [T, Hq, D]
    key: torch.Tensor  # [T, Hkv, D]
    value: torch.Tensor

    @property
    def head_size(self) -> int:
        return int(self.query.shape[-1])


def make_case(
    shapes: list[tuple[int, int]],
    block_size: int,
    head_size: int,
    group: int,
    dtype: torch.dtype,
    seed: int,
) -> Case:
    """A random case with the given ``(cached, new)`` sequences (see the module doc)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    seq_lens = [c + n for c, n in shapes]
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    width = max(blocks_per_seq) + 1  # at least one padding column everywhere
    owners = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.randint(0, num_blocks, (len(shapes), width), generator=gen)
    slots = []
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = torch.tensor(owners[:n], dtype=torch.int64)
        owners = owners[n:]
        pos = torch.arange(seq_lens[i])
        slots.append(tables[i, pos // block_size] * block_size + pos % block_size)

    keys = [randn(s, NUM_KV_HEADS, head_size) for s in seq_lens]
    values = [randn(s, NUM_KV_HEADS, head_size) for s in seq_lens]
    cached = [i for i, (c, _) in enumerate(shapes) if c > 0]
    prefix_batch = None
    if cached:
        prefix_batch = make_batch(
            [slots[i][: shapes[i][0]] for i in cached],
            [shapes[i][0] for i in cached],
            [shapes[i][0] for i in cached],
            tables[cached],
            block_size,
        )
    new = [n for _, n in shapes]
    return Case(
        block_size=block_size,
        num_blocks=num_blocks,
        prefix_batch=prefix_batch,
        prefix_key=_cat([keys[i][: shapes[i][0]] for i in cached], keys[0]),
        prefix_value=_cat([values[i][: shapes[i][0]] for i in cached], values[0]),
        batch=make_batch([s[c:] for s, (c, _) in zip(slots, shapes)], new, seq_lens,
                         tables, block_size),
        query=randn(sum(new), NUM_KV_HEADS * group, head_size),
        key=torch.cat([k[c:] for k, (c, _) in zip(keys, shapes)]),
        value=torch.cat([v[c:] for v, (c, _) in zip(values, shapes)]),
    )


def make_batch(
    slots: list[torch.Tensor],
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: torch.Tensor,
    block_size: int,
) -> AttentionBatch:
    """The :class:`AttentionBatch` of sequences whose new tokens go to ``slots[i]``."""
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    return AttentionBatch(
        slot_mapping=torch.cat(slots).long(),
        query_start_loc=torch.tensor(starts, dtype=torch.int64),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
        block_tables=block_tables.to(torch.int32),
        block_size=block_size,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens=tuple(query_lens),
    )


def batch_to(batch: AttentionBatch, device: torch.device) -> AttentionBatch:
    """The same batch with its tensors on ``device``."""
    return AttentionBatch(
        slot_mapping=batch.slot_mapping.to(device),
        query_start_loc=batch.query_start_loc.to(device),
        seq_lens=batch.seq_lens.to(device),
        block_tables=batch.block_tables.to(device),
        block_size=batch.block_size,
        max_query_len=batch.max_query_len,
        max_seq_len=batch.max_seq_len,
        query_lens=batch.query_lens,
    )


def new_cache(
    backend: AttentionBackend, case: Case, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A cache from the backend's own allocator, poisoned with NaN (see the module doc)."""
    cache = backend.allocate_kv_cache(
        case.num_blocks, case.block_size, NUM_KV_HEADS, case.head_size, dtype, device
    )
    if cache.is_floating_point():
        cache.fill_(float("nan"))
    return cache


def write_prefix(
    backend: AttentionBackend,
    case: Case,
    cache: torch.Tensor,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """The earlier steps: the cached prefixes, through the backend's ``write_kv``."""
    if case.prefix_batch is None:
        return
    metadata = backend.build_metadata(batch_to(case.prefix_batch, device))
    backend.write_kv(case.prefix_key.to(device, dtype), case.prefix_value.to(device, dtype),
                     cache, metadata)


def run_case(
    backend: AttentionBackend,
    case: Case,
    dtype: torch.dtype,
    device: torch.device,
    *,
    scale: float,
    sliding_window: int | None,
    logits_soft_cap: float | None,
) -> torch.Tensor:
    """Write the prefix, then run this step's ``forward``; returns the output [T, Hq, D].

    Inputs are cast to ``dtype`` (the reference runs the float32 copy of the same values).
    """
    cache = new_cache(backend, case, dtype, device)
    write_prefix(backend, case, cache, dtype, device)
    metadata = backend.build_metadata(batch_to(case.batch, device))
    return backend.forward(
        case.query.to(device, dtype),
        case.key.to(device, dtype),
        case.value.to(device, dtype),
        cache,
        metadata,
        scale=scale,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
    )


def _cat(parts: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    return torch.cat(parts) if parts else like[:0]
