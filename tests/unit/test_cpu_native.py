"""The cpu platform's native C kernels: building, loading, refusing, and the decode kernel
(float32, bfloat16, int8 and fp8 pages) against a float64 oracle on random inputs.

Tolerance: float32 ``rtol = atol = 1e-5`` against float64 (the kernel accumulates in
float32 in another order than torch; the gap seen is ~5e-7).
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
from quire.ops import kv_quant
from quire.platforms.cpu import native as native_module
from quire.platforms.cpu.native import NATIVE_ENV, NativeKernels, load_native_kernels

HAVE_CC = shutil.which("cc") is not None


def _paged(seed: int, lens: list[int], hq: int, hkv: int, d: int, block_size: int):
    """Random q and a paged cache holding each sequence's keys/values in shuffled
    blocks; every slot no sequence owns is NaN."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(per_seq) + 5
    order = torch.randperm(num_blocks, generator=gen)
    cache = torch.full((2, num_blocks, block_size, hkv, d), float("nan"))
    width = max(per_seq)
    tables = order[torch.randint(0, num_blocks, (len(lens), width), generator=gen)]
    keys, values, taken = [], [], 0
    for i, n in enumerate(lens):
        blocks = order[taken:taken + per_seq[i]]
        taken += per_seq[i]
        tables[i, :per_seq[i]] = blocks
        k = torch.randn(n, hkv, d, generator=gen)
        v = torch.randn(n, hkv, d, generator=gen)
        for j in range(n):
            cache[0, blocks[j // block_size], j % block_size] = k[j]
            cache[1, blocks[j // block_size], j % block_size] = v[j]
        keys.append(k)
        values.append(v)
    q = torch.randn(len(lens), hq, d, generator=gen)
    return q, cache, tables.long(), torch.tensor(lens, dtype=torch.int64), keys, values


def _dense(q, keys, values, scale, window):
    out = []
    for i in range(q.shape[0]):
        k, v = keys[i].double(), values[i].double()
        n = k.shape[0]
        start = max(0, n - window) if window else 0
        g = q.shape[1] // k.shape[1]
        k = k[start:].repeat_interleave(g, dim=1)  # [n, Hq, D]
        v = v[start:].repeat_interleave(g, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[i].double(), k) * scale
        out.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), v))
    return torch.stack(out)


@pytest.mark.parametrize("window", [None, 1, 6, 10_000])
@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 16), (9, 3, 64), (8, 2, 20), (2, 1, 5)])
@pytest.mark.parametrize("block_size", [1, 7, 16])
def test_decode_matches_dense_float64(
    kernels: NativeKernels, window: int | None, hq: int, hkv: int, d: int, block_size: int
) -> None:
    lens = [1, 17, 40, 3, 16, 29]
    q, cache, tables, seq_lens, keys, values = _paged(block_size + hq, lens, hq, hkv, d,
                                                      block_size)
    out = kernels.paged_decode(q, cache, tables, seq_lens, 0.3, window)
    assert out is not None and out.shape == q.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), _dense(q, keys, values, 0.3, window),
                               rtol=1e-5, atol=1e-5)


def test_decode_reads_a_row_of_a_wider_table(kernels: NativeKernels) -> None:
    """Block tables as a column slice of a wider one (row stride > width)."""
    q, cache, tables, seq_lens, keys, values = _paged(3, [5, 12], 4, 2, 8, 4)
    wide = torch.cat([tables, torch.zeros_like(tables)], dim=1)[:, :tables.shape[1]]
    assert not wide.is_contiguous()
    out = kernels.paged_decode(q, cache, wide, seq_lens, 0.5, None)
    assert out is not None
    torch.testing.assert_close(out.double(), _dense(q, keys, values, 0.5, None),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d,block_size", [(4, 4, 16, 16), (9, 3, 64, 7), (2, 1, 5, 1)])
def test_decode_reads_bfloat16_pages(kernels: NativeKernels, query_dtype: torch.dtype,
                                     hq: int, hkv: int, d: int, block_size: int) -> None:
    """bfloat16 pages are widened exactly, so against float64 on the same rounded keys
    and values the float32 result holds float32's tolerance; a bfloat16 query's result
    is rounded to bfloat16 (2^-8 relative)."""
    lens = [1, 17, 40, 3]
    q, cache, tables, seq_lens, keys, values = _paged(hq + d, lens, hq, hkv, d, block_size)
    q = q.to(query_dtype)
    keys = [k.bfloat16().double() for k in keys]
    values = [v.bfloat16().double() for v in values]
    for window in (None, 6):
        out = kernels.paged_decode(q, cache.bfloat16(), tables, seq_lens, 0.3, window)
        assert out is not None and out.shape == q.shape and out.dtype == query_dtype
        tol = 1e-5 if query_dtype == torch.float32 else 8e-3
        torch.testing.assert_close(out.double(), _dense(q, keys, values, 0.3, window),
                                   rtol=tol, atol=tol)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("groups", [1, 3, 4, 8])
@pytest.mark.parametrize("d", [64, 128, 80, 72, 20])
def test_decode_covers_groups_head_dims_and_tails(kernels: NativeKernels,
                                                  kv_dtype: torch.dtype, groups: int,
                                                  d: int) -> None:
    """Each GQA group size the query heads of a KV head are computed together for; head
    dims that are whole 16- and 8-lane vectors, one with an 8-lane rest (72) and one with
    a scalar rest (20); contexts from 1 over the kernel's steps (4 positions, 32-position
    tiles) and the pages' ends, each with and without a window. Against float64 on the
    same (for bfloat16: rounded) keys and values, float32's tolerance."""
    lens = [1, 2, 3, 4, 5, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100]
    hkv = 2
    q, cache, tables, seq_lens, keys, values = _paged(d + groups, lens, groups * hkv, hkv,
                                                      d, 16)
    if kv_dtype == torch.bfloat16:
        keys = [k.bfloat16().float() for k in keys]
        values = [v.bfloat16().float() for v in values]
    for window in (None, 7, 33):
        out = kernels.paged_decode(q, cache.to(kv_dtype), tables, seq_lens, 0.125, window)
        assert out is not None
        torch.testing.assert_close(out.double(), _dense(q, keys, values, 0.125, window),
                                   rtol=1e-5, atol=1e-5)


@pytest.fixture
def two_threads():
    """At least two threads for the kernels' team (they share torch's OpenMP pool), so
    that a few sequences take the split path; the count is restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(2, before))
    yield
    torch.set_num_threads(before)


@pytest.mark.usefixtures("two_threads")
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.int8,
                                      torch.float8_e4m3fn])
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 2, 80), (4, 4, 16), (6, 1, 32)])
@pytest.mark.parametrize("lens", [[700], [1000, 3], [65, 129, 300, 1]])
def test_few_long_sequences_split_their_positions(kernels: NativeKernels,
                                                  kv_dtype: torch.dtype, hq: int, hkv: int,
                                                  d: int, lens: list[int]) -> None:
    """Fewer sequences than four a thread: each sequence's positions are cut into parts
    of at least 64 over the team (700 positions on two threads: four parts of 175), each
    part taking every head, its outputs left undivided with each head's top score and
    total, then combined. Against float64 over the values the pages hold, float32's
    tolerance, with windows that leave one part or several; a sequence of one position
    beside long ones."""
    q, cache, tables, seq_lens, keys, values = _paged(d + hq + len(lens), lens, hq, hkv, d,
                                                      16)
    if kv_dtype in (torch.int8, torch.float8_e4m3fn):
        if d % kv_quant.GROUP:
            pytest.skip("quantised pages take whole groups of 16")
        pages, held = _quantised(cache, kv_dtype)
        keys, values = _held(held, tables, seq_lens, 0), _held(held, tables, seq_lens, 1)
    else:
        pages = cache.to(kv_dtype)
        keys = [k.to(kv_dtype).double() for k in keys]
        values = [v.to(kv_dtype).double() for v in values]
    for window in (None, 100, 257):
        out = kernels.paged_decode(q, pages, tables, seq_lens, 0.125, window)
        assert out is not None
        torch.testing.assert_close(out.double(), _dense(q, keys, values, 0.125, window),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("two_threads")
def test_a_sequence_of_no_positions_gets_zeros_beside_split_ones(
        kernels: NativeKernels) -> None:
    """A row of no positions among few rows: zeros, whether the others are split into
    parts (300 positions) or read whole (one position), and the others as float64."""
    for lens in ([0, 300], [0, 1]):
        q, cache, tables, seq_lens, keys, values = _paged(7, [1, lens[1]], 9, 3, 64, 16)
        seq_lens[0] = 0
        out = kernels.paged_decode(q, cache.bfloat16(), tables, seq_lens, 0.125, None)
        assert out is not None and torch.equal(out[0], torch.zeros_like(out[0]))
        expected = _dense(q[1:], [k.bfloat16().double() for k in keys[1:]],
                          [v.bfloat16().double() for v in values[1:]], 0.125, None)
        torch.testing.assert_close(out[1:].double(), expected, rtol=1e-5, atol=1e-5)


def _quantised(cache: torch.Tensor, dtype: torch.dtype):
    """A float cache's pages as int8 or fp8 pages (rows of D + D / 8 with their scales),
    and the float32 values those pages hold."""
    pages = kv_quant.quantize(cache, dtype).view(dtype)
    return pages, kv_quant.dequantize(pages)


def _held(pages: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, half: int):
    """Each sequence's keys (half 0) or values (1) as ``pages`` hold them: [n, Hkv, D]."""
    block = pages.shape[2]
    return [torch.stack([pages[half, tables[i, j // block], j % block] for j in range(n)])
            for i, n in enumerate(lens.tolist())]


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("groups", [1, 3, 8])
@pytest.mark.parametrize("d", [64, 80, 128])
def test_decode_reads_quantised_pages(kernels: NativeKernels, kv_dtype: torch.dtype,
                                      groups: int, d: int) -> None:
    """int8 and fp8 pages (a float16 scale per 16 values after each row): each group of a
    key or value row is read times its scale. Against float64 over the values the pages
    hold (kv_quant.dequantize), float32's tolerance; GQA groups, head sizes of 4, 5 and
    8 scale groups, contexts over the kernel's steps and tiles, windows."""
    lens = [1, 2, 3, 4, 5, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100]
    hkv = 2
    q, cache, tables, seq_lens, _, _ = _paged(d + groups, lens, groups * hkv, hkv, d, 16)
    pages, held = _quantised(cache, kv_dtype)
    keys, values = _held(held, tables, seq_lens, 0), _held(held, tables, seq_lens, 1)
    for window in (None, 7, 33):
        out = kernels.paged_decode(q, pages, tables, seq_lens, 0.125, window)
        assert out is not None and out.dtype == torch.float32
        torch.testing.assert_close(out.double(), _dense(q, keys, values, 0.125, window),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("query_dtype", [torch.bfloat16, torch.float16])
def test_decode_widens_a_narrow_query_over_quantised_pages(
        kernels: NativeKernels, kv_dtype: torch.dtype, query_dtype: torch.dtype) -> None:
    """A bfloat16 model's rows over int8 or fp8 pages take the kernel too (the torch path
    dequantises every page each step): widened to float32 exactly, the float32 result
    rounded back."""
    lens = [1, 17, 64, 100]
    q, cache, tables, seq_lens, _, _ = _paged(5, lens, 6, 2, 64, 16)
    pages, _ = _quantised(cache, kv_dtype)
    narrow = q.to(query_dtype)
    out = kernels.paged_decode(narrow, pages, tables, seq_lens, 0.125, None)
    wide = kernels.paged_decode(narrow.float(), pages, tables, seq_lens, 0.125, None)
    assert out is not None and out.dtype == query_dtype
    assert torch.equal(out, wide.to(query_dtype))


def _every_fp8_byte_as_values(hkv: int = 1, d: int = 64):
    """Pages whose value rows, scales 1, hold every e4m3fn byte but the two NaNs (four
    sequences of one position each, a row of 64 bytes each), and what torch widens them
    to."""
    codes = torch.arange(256, dtype=torch.int32)
    codes = codes[(codes & 0x7f) != 0x7f]  # the NaNs: never written (values are clamped)
    codes = torch.cat([codes, codes[:256 - codes.numel()]]).to(torch.uint8).view(4, 1, d)
    pages = torch.zeros(2, 4, 1, hkv, kv_quant.row_size(d, torch.int8), dtype=torch.uint8)
    pages[1, :, 0, :, :d] = codes
    pages[..., d:] = torch.ones(d // kv_quant.GROUP, dtype=torch.float16).view(torch.uint8)
    widened = codes.view(torch.float8_e4m3fn).float()  # [4, 1, d]
    return pages.view(torch.float8_e4m3fn), widened


def test_every_fp8_byte_is_read_as_torch_widens_it(kernels: NativeKernels) -> None:
    """One position per sequence: its softmax weight is 1, so the output is its value row
    as the kernel widens it, which must be torch's e4m3fn -> float32 for every byte
    (subnormals included), bit for bit (a sum starting at +0 cannot keep -0's sign,
    so zeros compare as values)."""
    pages, widened = _every_fp8_byte_as_values()
    tables = torch.arange(4, dtype=torch.int64).view(4, 1)
    lens = torch.ones(4, dtype=torch.int64)
    q = torch.zeros(4, 2, 64)
    out = kernels.paged_decode(q, pages, tables, lens, 1.0, None)
    assert out is not None
    expected = widened.expand(4, 2, 64)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn])
def test_quantised_writes_are_torch_s_bytes(kernels: NativeKernels,
                                            kv_dtype: torch.dtype) -> None:
    """Keys and values quantised into int8 or fp8 pages in C (``write_kv_quant``, as the
    fused layer's decode rows write them) are kv_quant.write_kv's bytes, bit for bit:
    rows over 11 decades (scales float16 subnormals at the low end, capped at 65504 at
    the high), all-zero rows and groups (scale 1), a group whose one huge element sends
    the others to fp8's subnormals and zero, int8's ties (x / s at k + 0.5), and strided
    rows (a fused q/k/v projection's)."""
    gen = torch.Generator().manual_seed(5)
    t, hkv, d = 41, 3, 64
    qkv = torch.randn(t, (2 + 2 * hkv) * d, generator=gen)
    qkv *= torch.logspace(-8, 8, t)[:, None]
    key = qkv[:, 2 * d:(2 + hkv) * d].view(t, hkv, d)
    value = qkv[:, (2 + hkv) * d:].view(t, hkv, d)
    key[0] = 0.0
    value[1, 2] = 0.0
    key[2, 1] = torch.randn(d, generator=gen)
    key[2, 1, 7] = 1e6
    value[4, 0, 16:32] = 0.0  # one zero group
    key[3, 0] = (torch.arange(d) % 16 - 7.5) * 2  # groups of absmax 15: x / s on halves
    key[3, 0, ::16] = 127.0 / 4
    assert key.stride(0) == value.stride(0) == qkv.shape[1]
    slots = torch.randperm(8 * 16, generator=gen)[:t]
    expected = torch.zeros(2, 8, 16, hkv, kv_quant.row_size(d, kv_dtype), dtype=kv_dtype)
    kv_quant.write_kv(expected, slots, key, value)
    written = torch.zeros_like(expected)
    assert kernels.write_kv_quant(written, slots, key, value)
    assert torch.equal(written.view(torch.uint8), expected.view(torch.uint8))
    # what it does not take: nothing written
    untouched = torch.zeros_like(expected)
    assert not kernels.write_kv_quant(untouched, slots, key.double(), value.double())
    assert not kernels.write_kv_quant(untouched.float(), slots, key, value)
    assert not kernels.write_kv_quant(untouched, slots.int(), key, value)
    assert not untouched.view(torch.uint8).any()


def test_inputs_it_does_not_take_are_declined(kernels: NativeKernels) -> None:
    q, cache, tables, seq_lens, _, _ = _paged(4, [5, 9], 4, 2, 8, 4)
    assert kernels.paged_decode(q.half(), cache.half(), tables, seq_lens, 1.0, None) is None
    assert kernels.paged_decode(q.half(), cache.bfloat16(), tables, seq_lens, 1.0,
                                None) is None
    assert kernels.paged_decode(q, cache, tables.int(), seq_lens, 1.0, None) is None
    assert kernels.paged_decode(q, cache.transpose(1, 2), tables, seq_lens, 1.0,
                                None) is None
    assert kernels.paged_decode(q[:, :3], cache, tables, seq_lens, 1.0, None) is None
    q, cache, tables, seq_lens, _, _ = _paged(4, [5, 9], 4, 2, 16, 4)
    pages = kv_quant.quantize(cache, torch.int8).view(torch.int8)
    assert kernels.paged_decode(q, pages, tables, seq_lens, 1.0, None) is not None
    assert kernels.paged_decode(q, pages[..., :-2].contiguous(), tables, seq_lens, 1.0,
                                None) is None  # rows without their last scale
    assert kernels.paged_decode(q.double(), pages, tables, seq_lens, 1.0, None) is None


def test_a_build_is_reused(tmp_path: Path) -> None:
    if not HAVE_CC:
        pytest.skip("no C compiler on this host")
    first = load_native_kernels(tmp_path, prebuilt=None)
    second = load_native_kernels(tmp_path, prebuilt=None)
    assert first is not None and second is not None and first.path == second.path
    assert [p.name for p in tmp_path.iterdir()] == [first.path.name]  # no leftovers


def test_turned_off_or_without_a_compiler_it_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(NATIVE_ENV, "0")
    with caplog.at_level(logging.INFO, logger=native_module.__name__):
        assert load_native_kernels(tmp_path) is None
    assert NATIVE_ENV in caplog.text
    monkeypatch.delenv(NATIVE_ENV)
    caplog.clear()
    monkeypatch.setenv("CC", "no-such-compiler-quire")
    assert load_native_kernels(tmp_path, prebuilt=None) is None
    assert "no C compiler" in caplog.text
    caplog.clear()
    monkeypatch.setenv("CC", "false")  # found, but every build fails
    assert load_native_kernels(tmp_path, prebuilt=None) is None
    assert "native kernels unavailable" in caplog.text
    assert list(tmp_path.iterdir()) == []
