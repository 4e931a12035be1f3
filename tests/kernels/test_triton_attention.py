"""The Triton attention backend against the cpu reference backend, in Triton's interpreter.

``conftest.py`` sets ``TRITON_INTERPRET=1`` before triton is imported, so every kernel runs
on CPU tensors. Both backends receive the same random inputs (a seeded generator, never
zeros) and caches whose every slot that holds no token is NaN, so a kernel that reads a
slot it must not read gives NaN. Block tables are shuffled physical ids with random
padding past each sequence's last block.

Tolerances, against the cpu reference in the same dtype (both accumulate in float32):

- float32: rtol = atol = 1e-4 (largest difference measured: 1.5e-6).
- float16: rtol = atol = 2e-3. The kernels round softmax weights to float16 before the
  ``P @ V`` product (as on a GPU); the reference keeps them in float32. Largest
  difference measured: 2.0e-3, one float16 step of an output in [2, 4).
- bfloat16: rtol = atol = 2e-2. Largest difference measured: 1.6e-2, one bfloat16 step
  of an output in [2, 4), where float32 results that differ in the last bits round to
  neighbouring bfloat16 values. In the interpreter bfloat16 dot operands are widened to
  float32 (its bfloat16 ``tl.dot`` multiplies raw bits, triton-lang/triton#11584), so the
  GPU's bfloat16 rounding of the weights is not exercised here.

The interpreter is slow (about 0.5 s per step of these shapes), so the default cases are
small; bigger ones are marked slow.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from paged_cases import PagedCase, make_paged_case  # noqa: E402
from quire.interfaces.attention import AttentionBatch  # noqa: E402
from quire.kernels import TritonAttentionBackend, TritonAttentionConfig  # noqa: E402
from quire.ops.attention import ReferenceAttentionBackend  # noqa: E402

# (cached prefix length, new tokens) per sequence.
MIXED = [(0, 9), (15, 1), (12, 7), (16, 1), (0, 1), (3, 18)]
DECODE_ONLY = [(4, 1), (15, 1), (31, 1), (0, 1), (63, 1), (20, 1)]
PREFILL_ONLY = [(0, 5), (0, 19), (9, 9), (24, 3)]

TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}
FEATURES = {
    "plain": (None, None),
    "window": (6, None),
    "softcap": (None, 2.0),
    "window+softcap": (5, 2.0),
}
#: Small tiles so that these short sequences still take several tiles and query blocks.
SMALL = TritonAttentionConfig(prefill_block_q=8, prefill_tile_n=16, decode_tile_n=16)
#: Splits every decode sequence's keys four ways (some shares empty for short sequences).
SPLIT = TritonAttentionConfig(
    prefill_block_q=8, prefill_tile_n=16, decode_tile_n=16,
    decode_split_target=1 << 20, decode_min_tiles_per_split=1, decode_max_splits=4,
)


def make_case(
    seqs: list[tuple[int, int]],
    block_size: int,
    group: int,
    head_size: int,
    dtype: torch.dtype,
    num_kv_heads: int = 2,
    seed: int = 0,
) -> PagedCase:
    """Unwritten slots hold NaN: a kernel that reads one shows it."""
    return make_paged_case(seqs, block_size, group, dtype, num_kv_heads=num_kv_heads,
                           head_size=head_size, seed=seed)

def run(backend, case: PagedCase, scale: float, window: int | None, cap: float | None):
    """(output, cache after the write) of one forward on a private copy of the cache."""
    kv_cache = case.kv_cache.clone()
    metadata = backend.build_metadata(case.batch)
    out = backend.forward(case.query, case.key, case.value, kv_cache, metadata,
                          scale=scale, sliding_window=window, logits_soft_cap=cap)
    return out, kv_cache


def check_against_reference(
    case: PagedCase,
    config: TritonAttentionConfig = SMALL,
    feature: str = "plain",
    scale: float | None = None,
) -> float:
    """Assert the Triton result equals the reference's; return the max abs error."""
    window, cap = FEATURES[feature]
    scale = scale if scale is not None else case.query.shape[-1] ** -0.5
    expected, expected_cache = run(ReferenceAttentionBackend(), case, scale, window, cap)
    out, cache = run(TritonAttentionBackend(config), case, scale, window, cap)
    assert out.shape == case.query.shape and out.dtype == case.query.dtype
    assert torch.isfinite(out).all(), "a NaN slot was read, or a row saw no key"
    # Written slots bit-identical; every slot the step does not own still NaN.
    assert torch.equal(cache.isnan(), expected_cache.isnan())
    assert torch.equal(cache.nan_to_num(), expected_cache.nan_to_num())
    tol = TOLERANCE[case.query.dtype]
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol)
    return float((out.float() - expected.float()).abs().max())


# -- float32: every feature, block size, GQA ratio and head size ----------------------------

# (block_size, group, head_size, feature): every value of each axis appears, with the
# block sizes 1, 12 (not a power of two) and the head size 16 of the tiny test models.
MIXED_CASES = [
    (16, 1, 64, "plain"),
    (16, 2, 16, "window"),
    (8, 4, 64, "softcap"),
    (8, 2, 128, "window+softcap"),
    (12, 2, 64, "plain"),
    (12, 4, 16, "window+softcap"),
    (1, 2, 16, "softcap"),
    (1, 1, 64, "window"),
    (16, 4, 40, "plain"),  # a head size that is not a power of two
    (16, 4, 256, "window"),  # rows of 1 KiB: tiles shrink four-fold
]


@pytest.mark.parametrize(("block_size", "group", "head_size", "feature"), MIXED_CASES)
def test_mixed_batch_matches_reference(
    block_size: int, group: int, head_size: int, feature: str
) -> None:
    case = make_case(MIXED, block_size, group, head_size, torch.float32, seed=block_size + group)
    check_against_reference(case, feature=feature)


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("config", [SMALL, SPLIT], ids=["one-share", "split-k"])
def test_decode_only_matches_reference(config: TritonAttentionConfig, feature: str) -> None:
    case = make_case(DECODE_ONLY, 8, 4, 32, torch.float32, seed=3)
    backend = TritonAttentionBackend(config)
    splits = backend.decode_splits(backend.build_metadata(case.batch), 2, FEATURES[feature][0])
    assert (splits > 1) == (config is SPLIT)
    check_against_reference(case, config, feature)


@pytest.mark.parametrize("feature", ["plain", "window+softcap"])
@pytest.mark.parametrize("block_size", [12, 16])
def test_prefill_only_matches_reference(block_size: int, feature: str) -> None:
    """Whole prompts and chunks after a cached prefix, several query blocks each."""
    case = make_case(PREFILL_ONLY, block_size, 2, 64, torch.float32, seed=block_size)
    check_against_reference(case, feature=feature)


def test_general_kernel_also_handles_decode_rows() -> None:
    """With the decode kernel off, one-token rows go through the prefill kernel, unchanged."""
    case = make_case(MIXED, 8, 2, 32, torch.float32, seed=5)
    config = TritonAttentionConfig(
        prefill_block_q=8, prefill_tile_n=16, decode_tile_n=16, use_decode_kernel=False
    )
    check_against_reference(case, config, "window+softcap")


def test_large_gqa_group_is_split_into_head_chunks() -> None:
    """8 query heads per kv head with at most 16 rows a program: 4 chunks of 2 heads."""
    case = make_case(MIXED, 16, 8, 16, torch.float32, num_kv_heads=1, seed=8)
    config = TritonAttentionConfig(prefill_block_q=8, prefill_max_rows=16, prefill_tile_n=16)
    check_against_reference(case, config, "softcap")


def test_metadata_is_reused_across_layers() -> None:
    """One build_metadata serves several layers, each with its own cache and data."""
    layers = [make_case(MIXED, 8, 2, 16, torch.float32, seed=s) for s in (1, 1)]
    layers[1].query.mul_(-0.5)
    backend = TritonAttentionBackend(SMALL)
    metadata = backend.build_metadata(layers[0].batch)
    for case in layers:
        out = backend.forward(case.query, case.key, case.value, case.kv_cache.clone(),
                              metadata, scale=0.3)
        expected, _ = run(ReferenceAttentionBackend(), case, 0.3, None, None)
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


# -- half precision -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("config", [SMALL, SPLIT], ids=["one-share", "split-k"])
def test_half_dtypes_match_reference(dtype: torch.dtype, config: TritonAttentionConfig) -> None:
    case = make_case(MIXED, 16, 2, 64, dtype, seed=11)
    check_against_reference(case, config, "window+softcap")


# -- write_kv -------------------------------------------------------------------------------


def test_write_kv_changes_exactly_the_given_slots_and_skips_negative_ones() -> None:
    gen = torch.Generator().manual_seed(7)
    backend = TritonAttentionBackend()
    kv_cache = torch.randn(backend.kv_cache_shape(7, 3, 2, 16), generator=gen)
    before = kv_cache.clone()
    slots = torch.randperm(21, generator=gen)[:5]
    slots[2] = -1  # a padding token
    key, value = torch.randn(5, 2, 16, generator=gen), torch.randn(5, 2, 16, generator=gen)
    batch = AttentionBatch(
        slot_mapping=slots, query_start_loc=torch.tensor([0, 2, 5]),
        seq_lens=torch.tensor([2, 3]), block_tables=torch.zeros(2, 1, dtype=torch.int32),
        block_size=3, max_query_len=3, max_seq_len=3, query_lens=(2, 3),
    )
    # key/value as strided views, as a fused qkv projection hands them over
    backend.write_kv(key[:, :, :], value.transpose(0, 1).contiguous().transpose(0, 1),
                     kv_cache, backend.build_metadata(batch))

    flat, flat_before = kv_cache.view(2, 21, 2, 16), before.view(2, 21, 2, 16)
    real = slots >= 0
    assert torch.equal(flat[0, slots[real]], key[real])
    assert torch.equal(flat[1, slots[real]], value[real])
    untouched = torch.ones(21, dtype=torch.bool)
    untouched[slots[real]] = False
    assert torch.equal(flat[:, untouched], flat_before[:, untouched])


# -- refusals -------------------------------------------------------------------------------


def test_unsupported_inputs_are_refused() -> None:
    case = make_case(DECODE_ONLY, 8, 2, 16, torch.float32)
    backend = TritonAttentionBackend()
    metadata = backend.build_metadata(case.batch)
    with pytest.raises(ValueError, match="cache dtype"):
        backend.attend(case.query.double(), case.kv_cache.double(), metadata, scale=1.0)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        backend.attend(case.query[:, :3], case.kv_cache, metadata, scale=1.0)
    with pytest.raises(ValueError, match="sliding_window"):
        backend.attend(case.query, case.kv_cache, metadata, scale=1.0, sliding_window=0)
    with pytest.raises(ValueError, match="logits_soft_cap"):
        backend.attend(case.query, case.kv_cache, metadata, scale=1.0, logits_soft_cap=0.0)
    with pytest.raises(ValueError, match=r"not \[2, num_blocks, 8"):
        backend.attend(case.query, case.kv_cache[:, :, :4], metadata, scale=1.0)


# -- bigger shapes (slow) -------------------------------------------------------------------

LONG_MIXED = [(0, 40), (70, 1), (33, 1), (100, 12), (0, 1), (127, 1), (64, 30)]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("feature", list(FEATURES))
def test_long_mixed_batch_head_128(dtype: torch.dtype, feature: str) -> None:
    case = make_case(LONG_MIXED, 16, 4, 128, dtype, seed=21)
    config = TritonAttentionConfig(decode_split_target=64, decode_min_tiles_per_split=1,
                                   decode_tile_n=16)
    check_against_reference(case, config, feature)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_long_mixed_batch_head_256_half(dtype: torch.dtype) -> None:
    case = make_case(LONG_MIXED, 16, 2, 256, dtype, seed=22)
    check_against_reference(case, TritonAttentionConfig(), "window+softcap")


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [1, 5, 12, 32])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_long_mixed_batch_default_config(block_size: int, group: int) -> None:
    case = make_case(LONG_MIXED, block_size, group, 64, torch.float32, seed=block_size)
    check_against_reference(case, TritonAttentionConfig(), "window+softcap")
