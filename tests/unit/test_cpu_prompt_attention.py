"""The cpu platform's attention kernel for several tokens per sequence
(csrc/prompt_attention.c: fresh prompts over their own rows, chunks after a cached
prefix over pages) against a float64 oracle on random inputs, at every ISA level this
CPU runs.

Inputs are views into one fused q/k/v projection (rows with a stride, as the model
passes them), several prompts of lengths across the kernel's steps (4-row register
blocks, 16-position work items, 32/16/8-key tiles), GQA groups 1-8, head dims that are
whole vectors, one with an 8-lane rest (72) and one with a scalar rest (20). Chunks sit
after prefixes across tiles and pages, in shuffled blocks of 1 and 16 slots, every slot
no sequence owns NaN.

Tolerances: float32 ``rtol = atol = 1e-5`` against float64 (float32 sums in another
order; the gap seen is ~1e-6). bfloat16: the oracle reads the same bf16 inputs and is
rounded to bf16 itself; the kernel's float32 result rounded to bf16 may land one bf16
step (at most 2**-7 relative) away where the two sit on either side of a rounding
boundary.
"""

from __future__ import annotations

import pytest
import torch
from quire.ops import kv_quant
from quire.platforms.cpu.native import NativeKernels

LENS = [1, 2, 3, 4, 5, 15, 16, 17, 31, 32, 33, 47, 64, 65, 100]


def _inputs(seed: int, lens: list[int], hq: int, hkv: int, d: int, dtype: torch.dtype,
            lead: int = 3):
    """q, k, v [T, H, D] as views into one [T, (Hq + 2 Hkv) D] projection, the prompts
    (first row, rows) one after another from row ``lead``."""
    gen = torch.Generator().manual_seed(seed)
    total = lead + sum(lens)
    qkv = torch.randn(total, (hq + 2 * hkv) * d, generator=gen).to(dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    starts, at = [], lead
    for n in lens:
        starts.append(at)
        at += n
    return (q.view(total, hq, d), k.view(total, hkv, d), v.view(total, hkv, d),
            tuple(zip(starts, lens)))


def _dense(q, k, v, prompts, scale, window) -> torch.Tensor:
    """Each prompt causal over its own rows (the last ``window`` positions with one),
    float64, Hugging Face's repeat_interleave GQA."""
    outs = []
    for start, n in prompts:
        qq, kk, vv = (t[start:start + n].double() for t in (q, k, v))
        g = qq.shape[1] // kk.shape[1]
        kk, vv = kk.repeat_interleave(g, dim=1), vv.repeat_interleave(g, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qq, kk) * scale
        i = torch.arange(n)
        hidden = i[None, :] > i[:, None]
        if window is not None:
            hidden |= i[:, None] - i[None, :] >= window
        scores = scores.masked_fill(hidden, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv))
    return torch.cat(outs)


@pytest.mark.parametrize("groups", [1, 3, 4, 8])
@pytest.mark.parametrize("d", [64, 128, 72, 20])
def test_float32_matches_float64(kernels: NativeKernels, groups: int, d: int) -> None:
    hkv = 2
    q, k, v, prompts = _inputs(d + groups, LENS, groups * hkv, hkv, d, torch.float32)
    for window in (None, 1, 7, 33):
        out = kernels.prompt_attention(q, k, v, prompts, d ** -0.5, window)
        assert out is not None and out.dtype == torch.float32
        assert out.shape == (sum(LENS), groups * hkv, d)
        torch.testing.assert_close(out.double(), _dense(q, k, v, prompts, d ** -0.5, window),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("groups,d", [(3, 64), (1, 72), (8, 20)])
def test_bfloat16_matches_float64_rounded(kernels: NativeKernels, groups: int,
                                          d: int) -> None:
    hkv = 3
    q, k, v, prompts = _inputs(7 * d + groups, LENS, groups * hkv, hkv, d, torch.bfloat16)
    for window in (None, 9):
        out = kernels.prompt_attention(q, k, v, prompts, 0.3, window)
        assert out is not None and out.dtype == torch.bfloat16
        expected = _dense(q, k, v, prompts, 0.3, window).bfloat16().double()
        torch.testing.assert_close(out.double(), expected, rtol=2 ** -7, atol=1e-6)


def test_a_long_prompt_with_one_kv_head(kernels: NativeKernels) -> None:
    """Over many work items and tiles: one prompt of 700 positions, MQA (one KV head)."""
    q, k, v, prompts = _inputs(11, [700], 6, 1, 64, torch.float32, lead=0)
    out = kernels.prompt_attention(q, k, v, prompts, 0.125, None)
    torch.testing.assert_close(out.double(), _dense(q, k, v, prompts, 0.125, None),
                               rtol=1e-5, atol=1e-5)


def test_only_the_prompts_rows_are_read(kernels: NativeKernels) -> None:
    """Rows outside every prompt hold NaN, and one prompt's rows hold none of another's:
    a kernel reading past a prompt's first or last row shows it."""
    q, k, v, prompts = _inputs(5, [9, 40, 17], 6, 2, 16, torch.float32)
    for t in (q, k, v):
        t[:3] = float("nan")
    out = kernels.prompt_attention(q, k, v, prompts, 0.25, None)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), _dense(q, k, v, prompts, 0.25, None),
                               rtol=1e-5, atol=1e-5)
    # the middle prompt alone: the same rows as its share of the whole
    alone = kernels.prompt_attention(q, k, v, prompts[1:2], 0.25, None)
    torch.testing.assert_close(alone, out[9:49], rtol=0, atol=0)


def test_inputs_it_does_not_take_are_declined(kernels: NativeKernels) -> None:
    q, k, v, prompts = _inputs(3, [5, 9], 4, 2, 8, torch.float32)
    assert kernels.prompt_attention(q.half(), k.half(), v.half(), prompts, 1.0, None) is None
    assert kernels.prompt_attention(q, k.bfloat16(), v, prompts, 1.0, None) is None
    assert kernels.prompt_attention(q, k, v, (), 1.0, None) is None
    assert kernels.prompt_attention(q, k, v, ((3, 0),), 1.0, None) is None
    assert kernels.prompt_attention(q, k, v, ((10, 9),), 1.0, None) is None  # past the end
    assert kernels.prompt_attention(q.transpose(1, 2), k, v, prompts, 1.0, None) is None
    assert kernels.prompt_attention(q[:, :3], k, v, prompts, 1.0, None) is None  # 3 % 2
    assert kernels.prompt_attention(q, k.contiguous(), v, prompts, 1.0, None) is None


# -- chunks after a cached prefix, over pages ---------------------------------------------

#: (cached prefix, new tokens) per sequence: prefixes across tiles and pages, chunks
#: across items, a fresh prompt among them.
CHUNKS = [(1, 1), (15, 2), (16, 16), (17, 33), (100, 5), (0, 20), (40, 64), (3, 100)]


def _paged(seed: int, chunks: list[tuple[int, int]], hq: int, hkv: int, d: int,
           block_size: int, dtype: torch.dtype):
    """q rows of the new tokens (views into a wider projection), a cache holding every
    position of every sequence in shuffled blocks (NaN in every slot no sequence owns),
    block tables (their spare columns random valid ids), lengths, and each sequence's
    keys and values for the oracle."""
    gen = torch.Generator().manual_seed(seed)
    lens = [p + n for p, n in chunks]
    per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(per_seq) + 3
    order = torch.randperm(num_blocks, generator=gen)
    cache = torch.full((2, num_blocks, block_size, hkv, d), float("nan"))
    tables = order[torch.randint(0, num_blocks, (len(lens), max(per_seq) + 1), generator=gen)]
    keys, values, taken = [], [], 0
    for i, n in enumerate(lens):
        blocks = order[taken:taken + per_seq[i]]
        taken += per_seq[i]
        tables[i, :per_seq[i]] = blocks
        k = torch.randn(n, hkv, d, generator=gen).to(dtype).float()
        v = torch.randn(n, hkv, d, generator=gen).to(dtype).float()
        for j in range(n):
            cache[0, blocks[j // block_size], j % block_size] = k[j]
            cache[1, blocks[j // block_size], j % block_size] = v[j]
        keys.append(k)
        values.append(v)
    total = 2 + sum(n for _, n in chunks)
    q = torch.randn(total, (hq + hkv) * d, generator=gen).to(dtype)[:, :hq * d]
    q = q.view(total, hq, d)  # rows (hq + hkv) * d apart, as a fused projection's
    rows, at = [], 2
    for _, n in chunks:
        rows.append((at, n))
        at += n
    return (q, cache.to(dtype), tables.long().contiguous(),
            torch.tensor(lens, dtype=torch.int64), tuple(rows), keys, values)


def _dense_chunks(q, rows, lens, keys, values, scale, window) -> torch.Tensor:
    outs = []
    for (start, n), length, k, v in zip(rows, lens.tolist(), keys, values):
        qq = q[start:start + n].double()
        g = qq.shape[1] // k.shape[1]
        kk = k.double().repeat_interleave(g, dim=1)
        vv = v.double().repeat_interleave(g, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qq, kk) * scale
        pos = torch.arange(length - n, length)[:, None]
        j = torch.arange(length)[None, :]
        hidden = j > pos
        if window is not None:
            hidden |= pos - j >= window
        scores = scores.masked_fill(hidden, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv))
    return torch.cat(outs)


@pytest.mark.parametrize("groups,d", [(1, 64), (3, 64), (4, 72), (8, 20), (2, 128)])
@pytest.mark.parametrize("block_size", [1, 16])
def test_chunks_over_pages_match_float64(kernels: NativeKernels, groups: int, d: int,
                                         block_size: int) -> None:
    hkv = 2
    q, cache, tables, lens, rows, keys, values = _paged(d + groups + block_size, CHUNKS,
                                                        groups * hkv, hkv, d, block_size,
                                                        torch.float32)
    for window in (None, 1, 9, 50):
        out = kernels.chunk_attention(q, cache, tables, rows, lens, d ** -0.5, window)
        assert out is not None and out.dtype == torch.float32
        assert not out.isnan().any()  # no unowned (NaN) slot was read
        expected = _dense_chunks(q, rows, lens, keys, values, d ** -0.5, window)
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_chunks_over_bfloat16_pages_match_float64_rounded(kernels: NativeKernels) -> None:
    q, cache, tables, lens, rows, keys, values = _paged(3, CHUNKS, 9, 3, 64, 16,
                                                        torch.bfloat16)
    for window in (None, 20):
        out = kernels.chunk_attention(q, cache, tables, rows, lens, 0.125, window)
        assert out is not None and out.dtype == torch.bfloat16
        expected = _dense_chunks(q, rows, lens, keys, values, 0.125, window)
        torch.testing.assert_close(out.double(), expected.bfloat16().double(),
                                   rtol=2 ** -7, atol=1e-6)


def test_float32_chunks_over_bfloat16_pages_match_float64(kernels: NativeKernels) -> None:
    """A float32 model with bfloat16 pages: float32 rows over the pages widened, float32
    out, to float32 rounding of the rounded keys and values (what its decode steps read);
    the same numbers as the bfloat16 entry before it rounds its output."""
    q, cache, tables, lens, rows, keys, values = _paged(5, CHUNKS, 9, 3, 64, 16,
                                                        torch.bfloat16)
    q = q.float()
    for window in (None, 20):
        out = kernels.chunk_attention(q, cache, tables, rows, lens, 0.125, window)
        assert out is not None and out.dtype == torch.float32
        expected = _dense_chunks(q, rows, lens, keys, values, 0.125, window)
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn])
def test_float32_chunks_over_quantised_pages_match_float64(kernels: NativeKernels,
                                                           kv_dtype: torch.dtype) -> None:
    """int8 and fp8 pages (``kv_cache_dtype``): each position's head rows dequantised with
    their scales as they are gathered; to float32 rounding of what the pages hold."""
    q, cache, tables, lens, rows, keys, values = _paged(6, CHUNKS, 9, 3, 64, 16,
                                                        torch.float32)
    pages = kv_quant.quantize(cache, kv_dtype).view(kv_dtype)

    def held(x: torch.Tensor) -> torch.Tensor:  # quantisation is per head row
        return kv_quant.dequantize(kv_quant.quantize(x, kv_dtype).view(kv_dtype))

    keys, values = [held(k) for k in keys], [held(v) for v in values]
    for window in (None, 20):
        out = kernels.chunk_attention(q, pages, tables, rows, lens, 0.125, window)
        assert out is not None and out.dtype == torch.float32
        expected = _dense_chunks(q, rows, lens, keys, values, 0.125, window)
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    for narrow in (torch.bfloat16, torch.float16):  # a bfloat16 model's rows: widened
        out = kernels.chunk_attention(q.to(narrow), pages, tables, rows, lens, 0.125, None)
        wide = kernels.chunk_attention(q.to(narrow).float(), pages, tables, rows, lens,
                                       0.125, None)
        assert out is not None and out.dtype == narrow
        assert torch.equal(out, wide.to(narrow))
    assert kernels.chunk_attention(q, pages[..., :64].contiguous(), tables, rows, lens,
                                   0.125, None) is None  # rows without their scales


def test_a_fresh_prompt_over_pages_equals_it_over_its_rows(kernels: NativeKernels) -> None:
    """Prefix 0: the page walk and the projection-row walk are the same arithmetic."""
    q, cache, tables, lens, rows, keys, values = _paged(8, [(0, 45)], 6, 2, 32, 16,
                                                        torch.float32)
    paged = kernels.chunk_attention(q, cache, tables, rows, lens, 0.2, None)
    k, v = keys[0], values[0]
    padded = [torch.cat([torch.full((2, *t.shape[1:]), float("nan")), t]) for t in (k, v)]
    fresh = kernels.prompt_attention(q, padded[0], padded[1], rows, 0.2, None)
    torch.testing.assert_close(paged, fresh, rtol=0, atol=0)


def test_chunk_inputs_it_does_not_take_are_declined(kernels: NativeKernels) -> None:
    q, cache, tables, lens, rows, _, _ = _paged(4, [(5, 3), (0, 4)], 4, 2, 8, 4,
                                                torch.float32)
    call = kernels.chunk_attention
    assert call(q.bfloat16(), cache, tables, rows, lens, 1.0, None) is None  # dtypes differ
    assert call(q.half(), cache.bfloat16(), tables, rows, lens, 1.0, None) is None
    assert call(q.half(), cache.half(), tables, rows, lens, 1.0, None) is None
    assert call(q, cache, tables.int(), rows, lens, 1.0, None) is None
    assert call(q, cache, tables[:, :1], rows, lens, 1.0, None) is None  # too narrow
    assert call(q, cache, tables, rows, lens.int(), 1.0, None) is None
    assert call(q, cache, tables, rows[:1], lens, 1.0, None) is None
    assert call(q, cache, tables, ((2, 9), (5, 4)), lens, 1.0, None) is None  # 9 > 8
    assert call(q, cache.transpose(3, 4), tables, rows, lens, 1.0, None) is None
