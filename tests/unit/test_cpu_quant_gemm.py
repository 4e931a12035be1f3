"""The cpu platform's products on quantised weights (csrc/quant_gemm.c), at every ISA level
this host runs (the ``kernels`` fixture), against the torch reference.

Two kinds of check. One-hot rows of x read single weights: a product with 1.0 and sums of
zeros are exact, so ``y`` must equal the reference dequantiser's weights bit for bit
(the kernel's dequantisation is exact, as documented). Random rows: the kernel and
``F.linear(x, W.dequantize())`` sum the same float32 products in different orders; each
order's error is at most gamma_k * sum_c |x_c w_c| (gamma_k = k u / (1 - k u), u = 2^-24,
the classic bound for any summation order, FMAs included), so they may differ by twice
that (k + 1 terms with the bias), elementwise. ``w8a8`` is compared exactly.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from quire.ops.quantized import quantized_linear
from quire.platforms.cpu.native import NativeKernels
from quire.platforms.cpu.quant_linear import make_quantized_linear
from quire.quantization.formats import FORMATS, QuantFormat
from quire.quantization.tensor import QuantizedTensor

#: offsets of each GGUF block's f16 scale fields (ggml-common.h)
#: the amx level's build differs in this file's kernels (tests/unit/conftest.py)
pytestmark = pytest.mark.amx

F16_FIELDS = {"q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "q8_0": (0,),
              "q2_k": (80, 82), "q3_k": (108,), "q4_k": (0, 2), "q5_k": (0, 2),
              "q6_k": (208,)}
FLOATS = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
#: rows the direct path takes in one pass (csrc/quant_gemm.c's DIRECT_MAX_ROWS)
DIRECT_ROWS = 4
#: the levels with 512-bit vectors (quant_gemm.c's NL == 16)
AVX512_LEVELS = ("avx512", "avx512_bf16", "amx")


def make_weight(name: str, rows: int, cols: int, gen: torch.Generator) -> QuantizedTensor:
    """Random valid weights: random block bytes with small finite f16 scales (negative
    ones too); random int8 bytes (-128 included) and fp8 bytes but NaN; random floats."""
    fmt = FORMATS[name]
    if name in FLOATS:
        w = torch.randn(rows, cols, generator=gen).to(FLOATS[name])
        return QuantizedTensor(fmt, w.view(torch.uint8).reshape(rows, -1), cols)
    if fmt.row_scaled:
        data = torch.randint(0, 256, (rows, cols), generator=gen, dtype=torch.uint8)
        if name == "fp8_e4m3":
            data[(data & 0x7F) == 0x7F] = 0x3C
        return QuantizedTensor(fmt, data, cols, torch.rand(rows, generator=gen) * 0.1 + 0.01)
    blocks = rows * cols // fmt.block
    data = torch.randint(0, 256, (blocks, fmt.block_bytes), generator=gen, dtype=torch.uint8)
    for offset in F16_FIELDS[name]:
        scale = (torch.rand(blocks, generator=gen) * 0.04 - 0.01).half()
        data[:, offset:offset + 2] = scale.view(torch.uint8).reshape(-1, 2)
    return QuantizedTensor(fmt, data.reshape(rows, -1), cols)

def widths(name: str) -> tuple[int, ...]:
    """Multiples of 256, and for smaller blocks a width that is not one."""
    block = FORMATS[name].block
    return (256, 1280) + (() if block == 256 else (96,) if block == 32 else (37,))

def assert_close_to_reference(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                              bias: torch.Tensor | None) -> None:
    ref = F.linear(x, w, bias)
    terms = x.shape[1] + (bias is not None)
    u = 2.0 ** -24
    gamma = terms * u / (1 - terms * u)
    bound = x.abs() @ w.abs().t() + (0 if bias is None else bias.abs())
    assert ((y - ref).abs() <= 2 * gamma * bound).all(), (y - ref).abs().max()

@pytest.mark.parametrize("name", list(FORMATS))
def test_one_hot_rows_read_each_weight_exactly(kernels: NativeKernels, name: str) -> None:
    gen = torch.Generator().manual_seed(1)
    for cols in (512, widths(name)[-1]):
        weight = make_weight(name, 37, cols, gen)
        expected = weight.dequantize()
        eye = torch.eye(cols)
        # every column through the panel path (many rows), a few through the direct one
        y = kernels.quant_linear(eye, weight)
        assert torch.equal(y.t(), expected)
        for count in (1, 2, 3, 4):  # each of the direct path's row counts
            pick = torch.randperm(cols, generator=gen)[:count]
            assert torch.equal(kernels.quant_linear(eye[pick].contiguous(), weight).t(),
                               expected[:, pick])

@pytest.mark.parametrize("name", list(FORMATS))
def test_matches_f_linear_on_the_dequantised_weight(kernels: NativeKernels, name: str) -> None:
    gen = torch.Generator().manual_seed(2)
    for cols in widths(name):
        weight = make_weight(name, 37, cols, gen)
        w = weight.dequantize()
        for m in (1, 2, 3, 4, 7, 64):  # each of the direct path's row counts, then panels
            x = torch.randn(m, cols, generator=gen)
            bias = torch.randn(37, generator=gen) if m % 2 else None
            y = kernels.quant_linear(x, weight, bias)
            assert y is not None and y.shape == (m, 37)
            assert_close_to_reference(y, x, w, bias)

@pytest.mark.parametrize("name", ["q4_0", "q6_k", "int8", "f16"])
def test_strided_rows_into_a_slice_of_a_wider_output(kernels: NativeKernels,
                                                     name: str) -> None:
    gen = torch.Generator().manual_seed(3)
    block = max(FORMATS[name].block, 16)
    whole = make_weight(name, 40, 4 * 256, gen)
    weight = whole.narrow_cols(block, 2 * 256)  # rows further apart than their bytes
    assert weight.data.stride(0) > weight.data.shape[1]
    w = weight.dequantize()
    bias = torch.randn(40, generator=gen)
    for m in (2, 20):
        x = torch.randn(m, 512, generator=gen)
        wide = torch.full((m, 50), 7.0)
        out = wide[:, 3:43]
        assert kernels.quant_linear(x, weight, bias, out=out) is out
        assert_close_to_reference(out, x, w, bias)
        assert (wide[:, :3] == 7).all() and (wide[:, 43:] == 7).all()

def test_bad_formats_and_widths_are_refused(kernels: NativeKernels) -> None:
    bogus = QuantFormat("bogus", 99, 32, 18)
    weight = QuantizedTensor(bogus, torch.zeros(4, 36, dtype=torch.uint8), 64)
    with pytest.raises(ValueError, match="unknown weight format"):
        kernels.quant_linear(torch.ones(1, 64), weight)
    # the C entry point itself: 33 weights are not whole Q4_0 blocks
    x, y = torch.ones(1, 33), torch.empty(1, 4)
    w = torch.zeros(4, 36, dtype=torch.uint8)
    code = kernels._quant_f32(FORMATS["q4_0"].id, x.data_ptr(), 1, 33, w.data_ptr(), 36, 4,
                              None, None, y.data_ptr(), 4)
    assert code == 2
    # float64 rows are not the kernel's: None, so the caller keeps torch
    weight = make_weight("q8_0", 4, 64, torch.Generator().manual_seed(0))
    assert kernels.quant_linear(torch.ones(1, 64, dtype=torch.float64), weight) is None

def test_w8a8_equals_the_reference_exactly(kernels: NativeKernels) -> None:
    """Exact int32 sums scaled as the reference scales them, at every level: at the amx
    level whole 16 rows take AMX-INT8 tiles (16, 33 and 64 rows: tiles of 32 and of 16
    rows, and a row left over for the vector kernel), 37 weight rows a pair of 16-row
    panels and a partial one."""
    gen = torch.Generator().manual_seed(4)
    for cols in (256, 100, 1000):
        weight = make_weight("int8", 37, cols, gen)
        for m in (1, 3, 7, 16, 33, 64):
            x = torch.randn(m, cols, generator=gen) * 3
            x[0, : cols // 2] = 0
            if m > 1:
                x[1] = 0  # a zero row: scale 1
            bias = torch.randn(37, generator=gen) if m % 2 else None
            y = kernels.quant_linear_i8(x, weight, bias)
            ref = quantized_linear(x, weight, bias, int8_activations=True)
            assert torch.equal(y, ref), (y - ref).abs().max()
    # rows further apart than their bytes, into a slice of a wider output
    weight = make_weight("int8", 37, 300, gen).narrow_cols(8, 280)
    for m in (5, 40):
        x = torch.randn(m, 280, generator=gen)
        wide = torch.full((m, 40), 7.0)
        out = wide[:, 2:39]
        assert kernels.quant_linear_i8(x, weight, out=out) is out
        assert torch.equal(out, quantized_linear(x, weight, int8_activations=True))
        assert (wide[:, :2] == 7).all() and (wide[:, 39:] == 7).all()
    assert kernels.quant_linear_i8(x, make_weight("q8_0", 4, 64, gen)) is None

def test_w8a8_rows_take_the_amx_tiles_from_16_rows(kernels: NativeKernels) -> None:
    """The tiles' sums are the vector kernel's exactly, so only the count of tile
    sections tells which ran: at the amx level a product of 16 rows or more begins one,
    fewer rows never do; levels without AMX never begin one."""
    gen = torch.Generator().manual_seed(9)
    weight = make_weight("int8", 70, 320, gen)
    for m, tiles in ((1, False), (15, False), (16, True), (33, True), (64, True)):
        before = kernels.amx_sections()
        kernels.quant_linear_i8(torch.randn(m, 320, generator=gen), weight)
        ran = kernels.amx_sections() > before
        assert ran == (tiles and kernels.has_amx), (kernels.level, m)
    if kernels.level != "amx":
        assert kernels.amx_sections() == 0


def test_quantized_linear_keeps_the_reference_contract(kernels: NativeKernels) -> None:
    linear = make_quantized_linear(kernels)
    gen = torch.Generator().manual_seed(5)
    weight = make_weight("q4_k", 24, 512, gen)
    bias = torch.randn(24, generator=gen)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(2, 3, 512, generator=gen).to(dtype)
        y = linear(x, weight, bias)
        ref = quantized_linear(x, weight, bias)
        assert y.dtype == dtype and y.shape == (2, 3, 24)
        if dtype == torch.float32:
            torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)
        else:  # six rows: the bfloat16 path's weights are rounded to bfloat16 (the op's
            # documented latitude); the conformance suite's bound, 3e-2 of the largest
            torch.testing.assert_close(y.float(), ref.float(), rtol=3e-2,
                                       atol=3e-2 * ref.float().abs().max().item())
    w8 = make_weight("int8", 24, 512, gen)
    x = torch.randn(5, 512, generator=gen)
    assert torch.equal(linear(x, w8, bias, int8_activations=True),
                       quantized_linear(x, w8, bias, int8_activations=True))
    with pytest.raises(ValueError, match="int8 weights"):
        linear(x, weight, int8_activations=True)
    # without kernels: the reference itself
    assert make_quantized_linear(None) is quantized_linear


@pytest.mark.parametrize("name", list(FORMATS))
def test_bfloat16_rows_multiply_the_weights_rounded_to_bfloat16(kernels: NativeKernels,
                                                                name: str) -> None:
    """The bfloat16 path (AVX512_BF16 levels): one-hot rows give each dequantised weight
    rounded to bfloat16 exactly; random rows equal ``F.linear`` on the bfloat16 values
    summed in float32 (products of two bfloat16 values are exact in float32), to the
    summation-order bound above. Lower levels decline (None), so callers widen to float32."""
    gen = torch.Generator().manual_seed(6)
    for cols in widths(name):
        weight = make_weight(name, 37, cols, gen)
        w = weight.dequantize().to(torch.bfloat16).float()
        x = torch.randn(64, cols, generator=gen).to(torch.bfloat16)
        y = kernels.quant_linear_bf16(x, weight)
        if not kernels.has_quant_bf16:
            assert y is None
            continue
        if cols % 2:  # pairs need an even K: declined, the caller widens to float32
            assert y is None
            continue
        assert y is not None and y.dtype == torch.float32
        assert_close_to_reference(y, x.float(), w, None)
        bias = torch.randn(37, generator=gen)
        assert_close_to_reference(kernels.quant_linear_bf16(x[:5].contiguous(), weight, bias),
                                  x[:5].float(), w, bias)
        eye = torch.eye(cols, dtype=torch.bfloat16)
        assert torch.equal(kernels.quant_linear_bf16(eye, weight).t(), w)
    if kernels.has_quant_bf16:  # a row-parallel shard: rows further apart than their bytes
        block = max(FORMATS[name].block, 16)
        weight = make_weight(name, 40, 4 * 256, gen).narrow_cols(block, 2 * 256)
        assert weight.data.stride(0) > weight.data.shape[1]
        x = torch.randn(9, 512, generator=gen).to(torch.bfloat16)
        assert_close_to_reference(kernels.quant_linear_bf16(x, weight), x.float(),
                                  weight.dequantize().to(torch.bfloat16).float(), None)


def test_a_bfloat16_model_s_batched_products_take_the_bfloat16_path(
        kernels: NativeKernels) -> None:
    """Through the op: more than BF16_MIN_ROWS bfloat16 rows give the bfloat16 kernel's
    result (rounded to bfloat16), fewer the float32 one's, both close to the reference."""
    from quire.platforms.cpu.quant_linear import BF16_MIN_ROWS
    linear = make_quantized_linear(kernels)
    gen = torch.Generator().manual_seed(7)
    weight = make_weight("q4_k", 40, 512, gen)
    bias = torch.randn(40, generator=gen)
    for m in (BF16_MIN_ROWS, BF16_MIN_ROWS + 1, 64):
        x = torch.randn(m, 512, generator=gen).to(torch.bfloat16)
        y = linear(x, weight, bias)
        assert y.dtype == torch.bfloat16 and y.shape == (m, 40)
        wide = kernels.quant_linear(x.float(), weight, bias)
        narrow = kernels.quant_linear_bf16(x, weight, bias)
        expected = narrow if (m > BF16_MIN_ROWS and narrow is not None) else wide
        assert torch.equal(y, expected.to(torch.bfloat16))
        # the bfloat16 path multiplies the weights rounded to bfloat16; the other one the
        # op's float32 weights; either way the output is rounded to bfloat16 once
        w = weight.dequantize()
        if expected is narrow:
            w = w.to(torch.bfloat16).float()
        torch.testing.assert_close(y.float(), F.linear(x.float(), w, bias),
                                   rtol=1e-2, atol=1e-2)


def test_bfloat16_activations_round_a_float32_model_s_batches_only(
        kernels: NativeKernels) -> None:
    """``bf16_activations`` (the ``activations=bfloat16`` option): a float32 model's
    products of more than BF16_MIN_ROWS rows are the bfloat16 kernel's float32 sums on
    the rows rounded to bfloat16, left in float32 (the reference's rounded product, to
    float32 summation order); fewer rows are the bfloat16 decode rows' where the build has
    them (decode_activations auto follows bf16_activations), else, and with bf16_decode
    False, the float32 kernel's; every product without it is the float32 kernel's."""
    from quire.platforms.cpu.quant_linear import BF16_MIN_ROWS
    linear = make_quantized_linear(kernels)
    gen = torch.Generator().manual_seed(11)
    weight = make_weight("q4_1", 48, 512, gen)
    bias = torch.randn(48, generator=gen)
    for m in (1, BF16_MIN_ROWS, BF16_MIN_ROWS + 1, 64):
        x = torch.randn(2, m, 512, generator=gen)
        y = linear(x, weight, bias, bf16_activations=True)
        assert y.dtype == torch.float32 and y.shape == (2, m, 48)
        flat = x.reshape(-1, 512)
        wide = kernels.quant_linear(flat, weight, bias).reshape(2, m, 48)
        assert torch.equal(linear(x, weight, bias), wide)
        narrow = kernels.quant_linear_bf16(flat.to(torch.bfloat16), weight, bias)
        if 2 * m > BF16_MIN_ROWS and narrow is not None:
            assert torch.equal(y, narrow.reshape(2, m, 48))
            # the reference op's rounded product, to float32 summation order
            rounded_x = flat.to(torch.bfloat16).float()
            rounded_w = weight.dequantize().to(torch.bfloat16).float()
            assert torch.equal(quantized_linear(x, weight, bias, bf16_activations=True),
                               F.linear(rounded_x, rounded_w, bias).reshape(2, m, 48))
            assert_close_to_reference(y.reshape(-1, 48), rounded_x, rounded_w, bias)
        else:
            rows = kernels.quant_rows_bf16(flat, weight, bias)
            assert torch.equal(y, wide if rows is None else rows.reshape(2, m, 48))
            exact = make_quantized_linear(kernels, bf16_decode=False)
            assert torch.equal(exact(x, weight, bias, bf16_activations=True), wide)


@pytest.mark.parametrize("name", ["q4_1", "q4_k", "q6_k"])
def test_up_to_eight_rows_of_a_long_weight_keep_the_direct_path(kernels: NativeKernels,
                                                                 name: str) -> None:
    """Products of 5 to 8 rows take the direct path four rows at a time (the float32
    kernel's entry): bit for bit the products of their groups of four, each a direct
    call, in chunks of weight rows longer than one (DIRECT_CHUNK); Q6_K below AVX-512
    keeps the panels (no spread path there). Through the op, on a weight of at least
    LONG_ROW_COLS columns, bfloat16 activations keep the direct path up to
    BF16_MIN_ROWS_LONG rows, where a shorter weight takes the bfloat16 kernel after
    BF16_MIN_ROWS: the direct path with the rows rounded to bfloat16 where the build takes
    the format (decode_activations auto), float32 rows with bf16_decode False."""
    from quire.platforms.cpu.quant_linear import (
        BF16_MIN_ROWS,
        BF16_MIN_ROWS_LONG,
        LONG_ROW_COLS,
    )
    gen = torch.Generator().manual_seed(23)
    weight = make_weight(name, 600, LONG_ROW_COLS, gen)
    bias = torch.randn(600, generator=gen)
    for m in range(DIRECT_ROWS + 1, BF16_MIN_ROWS_LONG + 1):
        x = torch.randn(m, LONG_ROW_COLS, generator=gen)
        y = kernels.quant_linear(x, weight, bias)
        groups = [kernels.quant_linear(x[r:r + DIRECT_ROWS], weight, bias)
                  for r in range(0, m, DIRECT_ROWS)]
        panels = name == "q6_k" and kernels.level not in AVX512_LEVELS
        assert torch.equal(y, torch.cat(groups)) != panels
        assert_close_to_reference(y, x, weight.dequantize(), bias)
    for bf16_decode in (None, False):
        linear = make_quantized_linear(kernels, bf16_decode=bf16_decode)
        for cols, last_direct in ((LONG_ROW_COLS, BF16_MIN_ROWS_LONG), (512, BF16_MIN_ROWS)):
            w = weight.narrow_cols(0, cols)
            for m in (last_direct, last_direct + 1):
                x = torch.randn(m, cols, generator=gen)
                y = linear(x, w, None, bf16_activations=True)
                narrow = kernels.quant_linear_bf16(x, w, None)
                rows_bf16 = kernels.quant_rows_bf16(x, w, None)
                if m > last_direct and narrow is not None:
                    assert torch.equal(y, narrow)
                elif bf16_decode is None and rows_bf16 is not None:
                    assert torch.equal(y, rows_bf16)
                else:
                    assert torch.equal(y, kernels.quant_linear(x.contiguous(), w, None))


#: the formats the bfloat16 decode rows take (quire_quant_rows_bf16_fits)
BF16_ROWS_FORMATS = ("q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")


@pytest.mark.parametrize("name", BF16_ROWS_FORMATS)
def test_bfloat16_decode_rows_multiply_the_exact_weights(kernels: NativeKernels,
                                                         name: str) -> None:
    """``quant_rows_bf16`` (csrc/quant_gemm.c's direct_rows_spread_bf): rows rounded to
    bfloat16 as torch rounds them (ties to even), times the exact weights, float32 sums.
    One-hot rows read each weight bit for bit; random rows stay within the float32
    summation bound of F.linear on the rounded rows, for each of the direct path's row
    counts and groups of them (5 to 9 rows), with a bias, on strided rows."""
    if not kernels.has_quant_bf16:
        assert kernels.quant_rows_bf16(torch.ones(1, 256), make_weight(
            name, 4, 256, torch.Generator().manual_seed(0))) is None
        pytest.skip(f"level {kernels.level} has no bfloat16 products (AVX512_BF16)")
    gen = torch.Generator().manual_seed(31)
    whole = make_weight(name, 300, 4 * 256, gen)
    weights = [whole.narrow_cols(0, 3 * 256), whole.narrow_cols(256, 2 * 256)]
    if FORMATS[name].block == 32:
        # an odd number of blocks (the last pairs with zeros), few and many, and
        # SmolLM2's width (18 blocks) on strided rows
        weights += [make_weight(name, 300, 96, gen), whole.narrow_cols(32, 7 * 32),
                    make_weight(name, 300, 13 * 32, gen), whole.narrow_cols(32, 18 * 32)]
    for weight in weights:
        cols, w = weight.cols, weight.dequantize()
        eye = torch.eye(cols)
        for count in (1, 3, 4, 6):
            pick = torch.randperm(cols, generator=gen)[:count]
            pick[0] = cols - 1  # the last block's last weight
            y = kernels.quant_rows_bf16(eye[pick].contiguous(), weight)
            assert y is not None and torch.equal(y.t(), w[:, pick])
        for m in range(1, 10):
            x = torch.randn(m, cols, generator=gen) * 3
            # ties: 1 + 2^-8 rounds to 1, 1 + 3 * 2^-8 to 1 + 2^-6 (to even both)
            x[0, :3] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8)])
            bias = torch.randn(300, generator=gen) if m % 2 else None
            y = kernels.quant_rows_bf16(x, weight, bias)
            assert y is not None and y.shape == (m, 300)
            rounded = x.to(torch.bfloat16).float()
            assert_close_to_reference(y, rounded, w, bias)
            # and not the float32 rows' products: the rounding happened
            assert not torch.allclose(y, F.linear(x, w, bias), rtol=0, atol=1e-3)


def test_bfloat16_decode_rows_take_only_their_formats(kernels: NativeKernels) -> None:
    """Other formats, and widths that are not whole K-quant blocks, are declined (None:
    the caller keeps float32 rows), as the fused layers' parts are told
    (``quant_rows_bf16_fits``)."""
    gen = torch.Generator().manual_seed(32)
    for name in FORMATS:
        weight = make_weight(name, 8, 512, gen)
        taken = kernels.quant_rows_bf16(torch.randn(2, 512, generator=gen), weight)
        fits = kernels.quant_rows_bf16_fits(weight)
        assert (taken is not None) == fits
        assert fits == (kernels.has_quant_bf16 and name in BF16_ROWS_FORMATS)
    code = kernels._quant_rows_bf16(FORMATS["q4_k"].id, None, 1, 300, None, 0, 4, None,
                                    None, 4)
    assert code == 4  # 300 columns are not whole blocks


@pytest.mark.parametrize("name", ["q4_1", "q6_k", "f16", "int8"])
def test_float32_rows_are_rounded_in_the_call_as_torch_rounds_them(kernels: NativeKernels,
                                                                   name: str) -> None:
    """``quant_linear_bf16`` on float32 rows (``quire_quant_gemm_bf16_f32``) rounds them
    in the kernel's call: bit for bit the product of the rows torch rounds to bfloat16
    first, ties to even included, for row counts that grow and shrink the call's buffer
    (tiles, tails, fewer than a tile)."""
    if not kernels.has_quant_bf16:
        pytest.skip(f"level {kernels.level} has no bfloat16 products (AVX512_BF16)")
    gen = torch.Generator().manual_seed(12)
    cols = 512
    weight = make_weight(name, 40, cols, gen)
    bias = torch.randn(40, generator=gen)
    for m in (5, 64, 7, 300, 16):
        x = torch.randn(m, cols, generator=gen)
        # ties: 1 + 2^-8 rounds to 1, 1 + 3 * 2^-8 to 1 + 2^-6 (to even both)
        x[0, :4] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2**-130])
        y = kernels.quant_linear_bf16(x, weight, bias if m % 2 else None)
        want = kernels.quant_linear_bf16(x.to(torch.bfloat16), weight,
                                         bias if m % 2 else None)
        assert y is not None and y.dtype == torch.float32
        assert torch.equal(y, want)


def test_a_layer_s_parts_in_one_call_are_the_op_s_part_by_part(
        kernels: NativeKernels) -> None:
    """``quant_parts_bf16`` (``quire_quant_gemm_bf16_parts``): a layer's parts in mixed
    formats (a Q4_K_M file's q and k in Q4_K, v in Q6_K; an int8 part with its row
    scales), part sizes that split panels between threads at any boundary, float32 and
    bfloat16 rows. Each part's columns equal ``quant_linear_bf16`` on that part alone,
    bit for bit. Through the fused layer's product (``_QuantizedProduct``): the layer's
    kernel's output, bit for bit, with and without ``bf16_activations``, a bias, and
    rows the op keeps on float32 products (4 or fewer)."""
    from quire.ops.quantized import QuantizedLinearKernel
    from quire.platforms.cpu.fused_decode import _QuantizedProduct
    from quire.platforms.cpu.native import QPartArgs

    if not kernels.has_quant_bf16:
        pytest.skip(f"level {kernels.level} has no bfloat16 products (AVX512_BF16)")
    gen = torch.Generator().manual_seed(13)
    cols = 512
    parts = [make_weight("q4_k", 72, cols, gen), make_weight("q4_k", 40, cols, gen),
             make_weight("q6_k", 24, cols, gen), make_weight("int8", 9, cols, gen)]
    array = QPartArgs.array(parts)
    total = sum(p.rows for p in parts)
    for dtype in (torch.float32, torch.bfloat16):
        for m in (5, 64, 33):
            x = torch.randn(m, cols, generator=gen).to(dtype)
            y = kernels.quant_parts_bf16(x, array, total)
            assert y is not None and y.shape == (m, total)
            want = torch.cat([kernels.quant_linear_bf16(x, p) for p in parts], dim=1)
            assert torch.equal(y, want)
    kernel = QuantizedLinearKernel(parts, make_quantized_linear(kernels), total)
    product = _QuantizedProduct(kernels, kernel, int8_rows=False)
    bias = torch.randn(total, generator=gen)
    for bf16_activations in (False, True):
        kernel.bf16_activations = bf16_activations
        for dtype in (torch.float32, torch.bfloat16):
            for m in (3, 5, 64):
                x = torch.randn(m, cols, generator=gen).to(dtype)
                b = bias.to(dtype) if m != 5 else None
                assert torch.equal(product(x, b), kernel(x, b))


@pytest.mark.parametrize("name", ["q4_1", "q6_k"])
def test_bfloat16_prompt_sized_batches(kernels: NativeKernels, name: str) -> None:
    """Rows too many for L2 beside a group of panels (a prompt step's: at the amx level
    the groups then widen so that the rows stream fewer times): whole groups, a narrower
    last one, a tail of rows, a bias; the same bound against ``F.linear`` on the rounded
    weights as the batches above."""
    if not kernels.has_quant_bf16:
        pytest.skip(f"level {kernels.level} has no bfloat16 products (AVX512_BF16)")
    gen = torch.Generator().manual_seed(9)
    block = FORMATS[name].block
    for cols, out in ((512 + block, 600), (4 * block, 1100)):
        weight = make_weight(name, out, cols, gen)
        w = weight.dequantize().to(torch.bfloat16).float()
        bias = torch.randn(out, generator=gen)
        m = (512 << 10) // (2 * cols) + 9  # past the rows that stay in L2, and a tail
        x = torch.randn(m, cols, generator=gen).to(torch.bfloat16)
        for b in (None, bias):
            y = kernels.quant_linear_bf16(x, weight, b)
            assert y is not None and y.shape == (m, out)
            assert_close_to_reference(y, x.float(), w, b)


@pytest.mark.parametrize("name", ["q4_1", "q8_0", "q4_k", "f16", "int8"])
def test_bfloat16_batches_on_amx_tiles_and_their_tails(kernels: NativeKernels,
                                                       name: str) -> None:
    """At the amx level the bfloat16 path multiplies whole 16 rows by whole 32-value K
    blocks on AMX tiles and the rest with vdpbf16ps; at every level the result is
    ``F.linear`` on the weights rounded to bfloat16, summed in float32, within the
    summation-order bound above. Rows: whole tiles, a tail, tiles and a tail, fewer than
    a tile; K: whole blocks, a 16-value tail after a block or in the second K chunk,
    less than a block; outputs: part of a panel, several panel groups."""
    if not kernels.has_quant_bf16:
        pytest.skip(f"level {kernels.level} has no bfloat16 products (AVX512_BF16)")
    if kernels.level == "amx" and not kernels.has_amx:
        pytest.skip("Linux refused this process AMX's tile state (arch_prctl)")
    gen = torch.Generator().manual_seed(8)
    block = max(FORMATS[name].block, 1)
    cols_list = (256, 592, 48, 16) if block == 1 else (512 + block, 2 * block)
    for cols in cols_list:
        for out in (37, 300):
            weight = make_weight(name, out, cols, gen)
            w = weight.dequantize().to(torch.bfloat16).float()
            bias = torch.randn(out, generator=gen)
            for m in (16, 21, 48, 64, 7):
                x = torch.randn(m, cols, generator=gen).to(torch.bfloat16)
                sections = kernels.amx_sections()
                y = kernels.quant_linear_bf16(x, weight, bias if m % 2 else None)
                # tiles at the amx level, and only there (none at all at a level without)
                assert (kernels.amx_sections() > sections) == (kernels.level == "amx")
                assert y is not None and y.shape == (m, out)
                assert_close_to_reference(y, x.float(), w, bias if m % 2 else None)
            # oneDNN's bfloat16 product (AMX tiles of its own configuration, on this
            # thread) between two calls leaves the kernel's result as it was
            x = torch.randn(32, cols, generator=gen).to(torch.bfloat16)
            first = kernels.quant_linear_bf16(x, weight)
            F.linear(x, w.to(torch.bfloat16))
            assert torch.equal(kernels.quant_linear_bf16(x, weight), first)
