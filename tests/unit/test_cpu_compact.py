"""Compact exact weight encodings (quire/platforms/cpu/compact.py) and the C kernel that
multiplies by them.

The encodings must give every float32 weight back bit for bit (a -0.0 may come back
+0.0), or refuse: weights are
made the way a GGUF reader makes them (``quire.quantization.dequant``'s dequantisers on
random blocks with float16 scales), or rounded to bf16, or plain random (refused).
Products are checked against float64 on random inputs (never zeros) with float32
``rtol = atol = 1e-5`` (the kernel sums in another order; ~2e-7 relative seen).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from quire.platforms.cpu.compact import FORMATS, CompactWeight, encode
from quire.platforms.cpu.native import NativeKernels
from quire.platforms.cpu.packed_linear import PackedLinear, onednn_available
from quire.quantization.dequant import BLOCK_DEQUANT

BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q8_0": 34}


def _gguf_blocks(qtype: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    """What the GGUF reader returns for a tensor of random ``qtype`` blocks: random
    codes, float16 scales (and minimums) of several magnitudes and signs. Each block
    holds the codes a quantiser gives its extreme weights (Q4_1: 0 and 15; Q4_0: 0;
    Q8_0: +-127), which is what the encoder's guess of the scale relies on."""
    rng = np.random.default_rng(seed)
    n = rows * cols // 32
    raw = rng.integers(0, 256, size=(n, BLOCK_BYTES[qtype]), dtype=np.uint8)
    scales = (rng.standard_normal(n) * 10.0 ** rng.integers(-4, 1, n)).astype(np.float16)
    if qtype == "Q4_1":  # d = (max - min) / 15 >= 0, m = min
        scales = np.abs(scales)
        mins = (rng.standard_normal(n) * 0.1).astype(np.float16)
        raw[:, 2:4] = mins.view(np.uint8).reshape(n, 2)
        raw[:, 4 + 3] = 0xF0  # weight 3 gets code 0, weight 19 code 15
    elif qtype == "Q4_0":
        raw[:, 2 + 5] &= 0xF0  # weight 5: code 0, the block's largest magnitude
    elif qtype == "Q5_0":  # w = d (q - 16): weight 0 gets code 0, magnitude 16 d
        raw[:, 2] &= 0xFE  # its high bit
        raw[:, 6] &= 0xF0  # its low nibble
    else:  # codes in -127..127, as round(x / (amax / 127)) gives
        raw[raw == 0x80] = 0x81
        raw[:, 2 + 11] = rng.choice(np.array([127, 129], dtype=np.uint8), n)  # +-127
    raw[:, 0:2] = scales.view(np.uint8).reshape(n, 2)
    return BLOCK_DEQUANT[qtype.lower()](torch.from_numpy(raw)).reshape(rows, cols)


def _quantized_like_llamacpp(qtype: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    """Gaussian weights through llama.cpp's reference quantiser (``gguf.quants``), then
    dequantised: the blocks a converted checkpoint really holds."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    weight = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    qt = GGMLQuantizationType[qtype]
    return torch.from_numpy(dequantize(quantize(weight * 0.05, qt), qt).copy())


@pytest.mark.parametrize(("qtype", "expected"), [("Q4_1", "a4"), ("Q4_0", "a4"),
                                                 ("Q5_0", "s8"), ("Q8_0", "s8")])
@pytest.mark.parametrize("make", [_gguf_blocks, _quantized_like_llamacpp])
def test_gguf_blocks_encode_exactly(qtype: str, expected: str, make) -> None:
    weight = make(qtype, 48, 256, seed=1)
    found = encode(weight)
    assert found is not None and found.format == expected
    assert torch.equal(found.decode(), weight)  # as numbers: -0.0 may come back +0.0
    zeros = weight == 0
    assert torch.equal(found.decode()[~zeros].view(torch.int32),
                       weight[~zeros].view(torch.int32))
    assert found.nbytes < weight.numel() * (1.2 if expected == "s8" else 0.8)


def test_bf16_weights_encode_exactly() -> None:
    weight = torch.randn(40, 64, generator=torch.Generator().manual_seed(2))
    weight = weight.to(torch.bfloat16).float()
    found = encode(weight)
    assert found is not None and found.format == "bf16"
    assert torch.equal(found.decode().view(torch.int32), weight.view(torch.int32))


def test_what_no_encoding_reproduces_is_refused() -> None:
    gen = torch.Generator().manual_seed(3)
    assert encode(torch.randn(16, 64, generator=gen)) is None  # full float32 mantissas
    q41 = _gguf_blocks("Q4_1", 16, 64, seed=4)
    assert encode(q41[:, :48].contiguous()) is None  # 48 columns: not whole blocks
    nudged = q41.clone()
    nudged[3, 7] = torch.nextafter(nudged[3, 7], torch.tensor(1.0))  # one weight, one ulp
    assert encode(nudged, formats=("a4", "s8")) is None
    with_nan = q41.clone()
    with_nan[0, 0] = float("nan")
    assert encode(with_nan) is None
    assert encode(q41.double()) is None and encode(q41[0]) is None


def test_formats_are_tried_smallest_first() -> None:
    """Small integers fit a4, s8 and bf16; the smallest (a4) wins, and a narrower choice
    of formats is honoured."""
    weight = torch.arange(16.0).repeat(8, 4)  # every block: 0..15 twice
    assert encode(weight).format == "a4"
    assert encode(weight, formats=("bf16",)).format == "bf16"
    found = encode(weight, formats=("s8",))  # 15 = 15 d with d = 1: Q5_0's form
    assert found.format == "s8" and torch.equal(found.decode(), weight)
    assert encode(weight * 0.1 + 0.37, formats=("s8",)) is None  # an offset: no d * q


def test_zero_blocks_and_negative_zeros() -> None:
    weight = _gguf_blocks("Q4_1", 8, 64, seed=6)
    weight[2, :32] = 0.0
    weight[5, 32:] = -0.0
    found = encode(weight)
    assert found is not None and torch.equal(found.decode(), weight)


# -- the kernel -----------------------------------------------------------------------------

# ``kernels`` (tests/unit/conftest.py): one build per ISA level this CPU runs.


def _weight(fmt: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    if fmt == "a4":
        return _gguf_blocks("Q4_1", rows, cols, seed)
    if fmt == "s8":
        return _gguf_blocks("Q8_0", rows, cols, seed)
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)).bfloat16().float()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 5])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize(("out_features", "in_features"), [(1, 32), (37, 96), (300, 576)])
def test_kernel_matches_float64(kernels: NativeKernels, fmt: str, rows: int, with_bias: bool,
                                out_features: int, in_features: int) -> None:
    weight = _weight(fmt, out_features, in_features, seed=out_features)
    found = encode(weight, formats=(fmt,))
    assert found is not None and found.format == fmt
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(rows, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    got = kernels.compact_linear(x, found, bias)
    expected = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    scale = expected.abs().max()
    torch.testing.assert_close(got.double() / scale, expected / scale, rtol=1e-5, atol=1e-5)


def test_kernel_declines_what_it_does_not_take(kernels: NativeKernels) -> None:
    found = encode(_weight("a4", 8, 64, seed=1))
    assert kernels.compact_linear(torch.randn(1, 64).double(), found, None) is None
    assert kernels.compact_linear(torch.randn(1, 32), found, None) is None
    assert kernels.compact_linear(torch.randn(64), found, None) is None
    assert kernels.compact_linear(torch.randn(1, 64), found, torch.randn(8).double()) is None
    strided = torch.randn(1, 128)[:, ::2]  # made contiguous, not refused
    torch.testing.assert_close(kernels.compact_linear(strided, found, None),
                               F.linear(strided, found.decode()), rtol=1e-5, atol=1e-5)
    bogus = CompactWeight("a4", found.codes, found.scales, found.offsets, 8, 48)
    assert kernels.compact_linear(torch.randn(1, 48), bogus, None) is None  # 48 % 32


@pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_runs_one_row_on_the_compact_copy(kernels: NativeKernels,
                                                        with_bias: bool) -> None:
    weight = _weight("a4", 200, 96, seed=9)
    bias = torch.randn(200) if with_bias else None
    linear = PackedLinear(weight, kernels)
    assert linear.compact is not None and linear.split is None  # no per-thread copy for it
    assert (linear.panels is not None) == kernels.has_panel_gemm
    for rows in (1, 3, 64, 300):  # 1: compact; up to 256: panels (with AVX2); oneDNN
        x = torch.randn(2, rows, 96)
        expected = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
        scale = expected.abs().max()  # relative to the output's scale, as above
        torch.testing.assert_close(linear(x, bias).double() / scale, expected / scale,
                                   rtol=1e-5, atol=1e-5)
    plain = PackedLinear(torch.randn(200, 96), kernels)
    assert plain.compact is None
    # one row of a weight without encoding: the panel kernel, else the per-thread copy
    assert (plain.panels is not None) != (plain.split is not None)
