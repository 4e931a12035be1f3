"""The Triton attention kernels on int8 / fp8 KV pages (rows of D + D / 8: the values, then
a float16 scale per 16 of them), in the interpreter, against the reference reading the same pages;
and the fp8 e4m3 decode by bits against torch for every byte."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from quire.conformance.cases import NUM_KV_HEADS, SHAPES, make_case  # noqa: E402
from quire.conformance.context import CheckContext  # noqa: E402
from quire.conformance.kv_quant_ops import check_quantized_kv  # noqa: E402
from quire.conformance.report import Outcome  # noqa: E402
from quire.kernels.triton_attention import _fp8_e4m3_to_f32  # noqa: E402
from quire.kernels.triton_backend import TritonAttentionBackend, TritonAttentionConfig  # noqa: E402
from quire.ops.attention import ReferenceAttentionBackend  # noqa: E402

tl = triton.language

QUANT = [torch.int8, torch.float8_e4m3fn]
#: small tiles and eager splitting, so the split-K decode and multi-tile prefill run
SMALL = TritonAttentionConfig(prefill_block_q=4, prefill_max_rows=16, prefill_tile_n=16,
                              decode_tile_n=16, decode_split_target=64,
                              decode_min_tiles_per_split=1)


def _forward(backend, case, dtype, window=None, cap=None):
    cache = backend.allocate_kv_cache(case.num_blocks, case.block_size, NUM_KV_HEADS,
                                      case.head_size, dtype, torch.device("cpu"))
    cache.view(torch.uint8).fill_(0x7F)  # fp8 NaN; int8 rows with a 3.4e38 scale
    if case.prefix_batch is not None:
        backend.write_kv(case.prefix_key, case.prefix_value, cache,
                         backend.build_metadata(case.prefix_batch))
    out = backend.forward(case.query, case.key, case.value, cache,
                          backend.build_metadata(case.batch), scale=0.25,
                          sliding_window=window, logits_soft_cap=cap)
    return out.float(), cache


@pytest.mark.parametrize("dtype", QUANT)
@pytest.mark.parametrize("kind", list(SHAPES))
@pytest.mark.parametrize("model_dtype, group, window, cap",
                         [(torch.float32, 2, None, None), (torch.bfloat16, 4, 3, 20.0)])
def test_kernels_match_the_reference_on_the_same_pages(dtype, kind, model_dtype, group,
                                                       window, cap):
    case = make_case(SHAPES[kind](4), 4, 32, group, model_dtype, 7)
    want, ref_cache = _forward(ReferenceAttentionBackend(), case, dtype, window, cap)
    got, cache = _forward(TritonAttentionBackend(SMALL), case, dtype, window, cap)
    assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8))
    assert torch.isfinite(got).all()
    tol = 1e-5 if model_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("kind", ["decode", "mixed"])
@pytest.mark.parametrize("head_size", [80, 256])
def test_int8_pages_at_padded_and_long_heads(kind, head_size):
    """The queries and outputs taken into and back from the Hadamard basis group by group:
    a head of 80 (five groups, padded to 128 lanes) and Gemma 3's 256."""
    case = make_case(SHAPES[kind](4), 4, head_size, 2, torch.float32, 11)
    want, ref_cache = _forward(ReferenceAttentionBackend(), case, torch.int8)
    got, cache = _forward(TritonAttentionBackend(SMALL), case, torch.int8)
    assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@triton.jit
def _decode_bytes(x_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, _fp8_e4m3_to_f32(tl.load(x_ptr + i)))


def test_fp8_decode_by_bits_is_torchs_for_every_byte():
    x = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    out = torch.empty(256, dtype=torch.float32)
    _decode_bytes[(1,)](x, out, N=256)
    want = x.view(torch.float8_e4m3fn).float()
    torch.testing.assert_close(out, want, atol=0, rtol=0, equal_nan=True)


def test_conformance_rows_for_the_triton_backend():
    class Platform:
        def make_attention_backend(self):
            return TritonAttentionBackend(SMALL)

    ctx = CheckContext(platform=Platform(), device=torch.device("cpu"),
                       dtypes=(torch.float32,), block_sizes=(16,), seed=0,
                       kernels_only=True, expected_name="triton", spawn_platform=None)
    rows = check_quantized_kv(ctx)
    assert [r.case for r in rows] == ["int8 pages, float32", "fp8 pages, float32"]
    assert all(r.outcome is Outcome.PASS for r in rows), rows
