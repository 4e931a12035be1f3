"""The cpu reference attention against a naive dense attention written here.

Every input is random (a seeded generator, never zeros), the cache starts full of random
garbage so a mask that lets an unwritten slot through shows up, and block tables are
shuffled physical ids with random padding past each sequence's last block.

Tolerances: float32 rtol = atol = 1e-5 against a float64 reference. bfloat16 rtol =
atol = 1e-2: inputs are the same bf16 values on both sides, so the gap is the final
cast of the output to bf16 (relative step 2**-8) plus float32 accumulation.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from paged_cases import PagedCase, make_paged_case
from quire.interfaces.attention import AttentionBatch
from quire.ops.attention import ReferenceAttentionBackend

HEAD_SIZE = 8
NUM_KV_HEADS = 2

# (cached prefix length, new tokens) per sequence.
MIXED = [(0, 7), (5, 1), (13, 6), (16, 1), (0, 1), (2, 20), (30, 1)]
DECODE_ONLY = [(4, 1), (15, 1), (31, 1), (0, 1)]
PREFILL_ONLY = [(0, 5), (0, 17), (9, 9)]


def make_case(
    seqs: list[tuple[int, int]],
    block_size: int,
    group: int,
    dtype: torch.dtype,
    seed: int = 0,
    layout_seed: int | None = None,
) -> PagedCase:
    """Random K/V/queries from ``seed``; block placement from ``layout_seed`` (or ``seed``);
    unwritten slots hold random garbage (see the module doc)."""
    case = make_paged_case(seqs, block_size, group, dtype, num_kv_heads=NUM_KV_HEADS,
                           head_size=HEAD_SIZE, seed=seed, layout_seed=layout_seed,
                           unwritten="random")
    num_blocks = case.kv_cache.shape[1]
    assert case.kv_cache.shape == ReferenceAttentionBackend().kv_cache_shape(
        num_blocks, block_size, NUM_KV_HEADS, HEAD_SIZE)
    return case


def naive_attention(
    case: PagedCase, scale: float, window: int | None, soft_cap: float | None
) -> torch.Tensor:
    """One sequence at a time over contiguous K/V, float64, HF repeat_interleave GQA."""
    outs = []
    starts = case.batch.query_start_loc.tolist()
    for i, seq_len in enumerate(case.batch.seq_lens.tolist()):
        q = case.query[starts[i] : starts[i + 1]].double()  # [q, Hq, D]
        group = q.shape[1] // NUM_KV_HEADS
        k = case.full_keys[i].double().repeat_interleave(group, dim=1)  # [S, Hq, D]
        v = case.full_values[i].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        p = torch.arange(seq_len - q.shape[0], seq_len)[:, None]
        j = torch.arange(seq_len)[None, :]
        allowed = j <= p
        if window is not None:
            allowed &= j > p - window
        scores = scores.masked_fill(~allowed, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
    return torch.cat(outs)


TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
FEATURES = {
    "plain": (None, None),
    "window": (4, None),
    "softcap": (None, 1.5),
    "window+softcap": (5, 1.5),
}


def run_backend(
    case: PagedCase, scale: float, window: int | None, soft_cap: float | None
) -> torch.Tensor:
    backend = ReferenceAttentionBackend()
    metadata = backend.build_metadata(case.batch)
    return backend.forward(
        case.query,
        case.key,
        case.value,
        case.kv_cache,
        metadata,
        scale=scale,
        sliding_window=window,
        logits_soft_cap=soft_cap,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_mixed_batch_matches_naive(
    group: int, block_size: int, feature: str, dtype: torch.dtype
) -> None:
    window, soft_cap = FEATURES[feature]
    case = make_case(MIXED, block_size, group, dtype, seed=block_size * 10 + group)
    scale = HEAD_SIZE**-0.5
    out = run_backend(case, scale, window, soft_cap)
    assert out.shape == case.query.shape and out.dtype == dtype
    tol = TOLERANCE[dtype]
    expected = naive_attention(case, scale, window, soft_cap)
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("seqs", [DECODE_ONLY, PREFILL_ONLY], ids=["decode", "prefill"])
@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize("feature", ["plain", "window+softcap"])
def test_single_group_batches_match_naive(
    seqs: list[tuple[int, int]], block_size: int, feature: str
) -> None:
    window, soft_cap = FEATURES[feature]
    case = make_case(seqs, block_size, group=2, dtype=torch.float32, seed=block_size)
    out = run_backend(case, 0.4, window, soft_cap)
    expected = naive_attention(case, 0.4, window, soft_cap)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_metadata_is_reused_across_layers() -> None:
    """One build_metadata serves several layers, each with its own cache and data."""
    backend = ReferenceAttentionBackend()
    layers = [make_case(MIXED, 3, 2, torch.float32, seed=s, layout_seed=0) for s in (1, 2)]
    metadata = backend.build_metadata(layers[0].batch)  # both layers share the layout
    for case in layers:
        out = backend.forward(
            case.query, case.key, case.value, case.kv_cache, metadata, scale=0.3
        )
        expected = naive_attention(case, 0.3, None, None)
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_write_kv_changes_exactly_the_given_slots() -> None:
    gen = torch.Generator().manual_seed(7)
    backend = ReferenceAttentionBackend()
    shape = backend.kv_cache_shape(num_blocks=7, block_size=3, num_kv_heads=2, head_size=4)
    kv_cache = torch.randn(shape, generator=gen)
    before = kv_cache.clone()
    slots = torch.randperm(7 * 3, generator=gen)[:5]
    key, value = torch.randn(5, 2, 4, generator=gen), torch.randn(5, 2, 4, generator=gen)
    batch = AttentionBatch(
        slot_mapping=slots,
        query_start_loc=torch.tensor([0, 2, 5]),
        seq_lens=torch.tensor([2, 3]),
        block_tables=torch.zeros(2, 1, dtype=torch.int32),
        block_size=3,
        max_query_len=3,
        max_seq_len=3,
        query_lens=(2, 3),
    )
    backend.write_kv(key, value, kv_cache, backend.build_metadata(batch))

    flat, flat_before = kv_cache.view(2, 21, 2, 4), before.view(2, 21, 2, 4)
    assert torch.equal(flat[0, slots], key)
    assert torch.equal(flat[1, slots], value)
    untouched = torch.ones(21, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(flat[:, untouched], flat_before[:, untouched])


def test_kv_cache_layout() -> None:
    backend = ReferenceAttentionBackend()
    assert backend.kv_cache_shape(10, 16, 4, 64) == (2, 10, 16, 4, 64)
    cache = backend.allocate_kv_cache(10, 16, 4, 64, torch.bfloat16, torch.device("cpu"))
    assert cache.shape == (2, 10, 16, 4, 64) and cache.dtype == torch.bfloat16


def test_too_narrow_block_tables_are_refused() -> None:
    case = make_case(PREFILL_ONLY, 3, 1, torch.float32)
    narrow = replace(case.batch, block_tables=case.batch.block_tables[:, :2])
    with pytest.raises(ValueError, match="needs 6 blocks"):
        ReferenceAttentionBackend().build_metadata(narrow)


@pytest.mark.parametrize("kwargs", [{"sliding_window": 0}, {"logits_soft_cap": -1.0}])
def test_bad_attention_options_are_refused(kwargs: dict) -> None:
    case = make_case(DECODE_ONLY, 3, 1, torch.float32)
    backend = ReferenceAttentionBackend()
    with pytest.raises(ValueError):
        metadata = backend.build_metadata(case.batch)
        backend.attend(case.query, case.kv_cache, metadata, scale=1.0, **kwargs)


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_unwritten_slots_never_leak_into_the_output(poison: float) -> None:
    """A fresh cache may hold any bits; NaN or inf past a sequence's end must not show."""
    block_size = 4
    case = make_case(MIXED, block_size=block_size, group=2, dtype=torch.float32, seed=3)
    flat = case.kv_cache.view(2, -1, NUM_KV_HEADS, HEAD_SIZE)
    keep = torch.zeros(flat.shape[1], dtype=torch.bool)
    for i, seq_len in enumerate(case.batch.seq_lens.tolist()):
        pos = torch.arange(seq_len)
        keep[case.batch.block_tables[i, pos // block_size].long() * block_size
             + pos % block_size] = True
    flat[:, ~keep] = poison
    out = run_backend(case, scale=HEAD_SIZE**-0.5, window=None, soft_cap=None)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), naive_attention(case, HEAD_SIZE**-0.5, None, None),
                               rtol=1e-5, atol=1e-5)
