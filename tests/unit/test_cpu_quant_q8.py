"""csrc/quant_q8.c: GGUF block weights times int8-quantised activations (integer dot
products), at every ISA level this host runs.

The oracle is ``F.linear(dequant_q8(x), W.dequantize())`` with ``dequant_q8`` the
activation blocks' ``q * d`` in float32. The kernel's integer sums are exact; what differs
is float rounding: the weights' scale products (the reference rounds every weight, the
kernel applies the scale once a block), the per-block float sums and their order. The
bound held, per output, is ``TOL_ULPS * eps32 * sum_b sum_c |d_b q_c| * G_jb`` with
``G_jb`` the largest ``|w|`` of the weight's 32-block (covering both terms of a
scale-and-minimum weight), plus the sum of ``k / 32`` block terms in float32:
``(k / 32 + TOL_ULPS) * eps32`` of that magnitude.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

from quire.platforms.cpu.native import NativeKernels
from quire.quantization.formats import FORMATS
from quire.quantization.random import random_quantized

FORMATS_Q8 = ("q4_k", "q6_k", "q8_0", "q4_0", "q4_1", "q5_k", "q5_0", "q5_1")
BLOCK32 = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
TOL_ULPS = 8
EPS = torch.finfo(torch.float32).eps


def dequant_q8(x: torch.Tensor) -> torch.Tensor:
    """Each row's 32-value blocks quantised as the kernel does, back to float32."""
    m, k = x.shape
    blocks = x.reshape(m, k // 32, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127.0
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.where(d > 0, torch.round(blocks / safe).clamp(-127, 127), torch.zeros_like(blocks))
    return (q * d).reshape(m, k)


def check(y: torch.Tensor, x: torch.Tensor, w_float: torch.Tensor,
          bias: torch.Tensor | None = None) -> None:
    xq = dequant_q8(x)
    expected = F.linear(xq, w_float, bias)
    k = x.shape[1]
    group_max = w_float.abs().reshape(w_float.shape[0], k // 32, 32).amax(-1, keepdim=True)
    magnitude = xq.abs().double() @ group_max.expand(-1, -1, 32).reshape(-1, k).double().T
    if bias is not None:
        magnitude = magnitude + bias.abs().double()
    tol = (k / 32 + TOL_ULPS) * EPS * magnitude + 1e-30
    err = (y.double() - expected.double()).abs()
    assert torch.all(err <= tol), f"worst {(err / tol).max().item():.2f} of the bound"


def sizes(fmt: str) -> tuple[int, ...]:
    return (256, 1024, 96) if fmt in BLOCK32 else (256, 1024)


@pytest.mark.parametrize("fmt", FORMATS_Q8)
def test_matches_oracle(kernels: NativeKernels, fmt: str) -> None:
    assert kernels.has_quant_q8
    g = torch.Generator().manual_seed(FORMATS[fmt].id)
    for k in sizes(fmt):
        weight = random_quantized(fmt, 37, k, g)
        w_float = weight.dequantize()
        assert kernels.quant_q8_fits(weight)
        for m in (1, 3, 9):
            x = torch.randn(m, k, generator=g)
            x[0, :32] = 0.0  # an all-zero block: d = 0
            check(kernels.quant_linear_q8(x, weight), x, w_float)
            bias = torch.randn(37, generator=g)
            check(kernels.quant_linear_q8(x, weight, bias), x, w_float, bias)


@pytest.mark.parametrize("fmt", FORMATS_Q8)
def test_strided_rows_and_out(kernels: NativeKernels, fmt: str) -> None:
    """A column slice of a wider weight (rows further apart than they are long), written
    into a slice of a wider output."""
    g = torch.Generator().manual_seed(100 + FORMATS[fmt].id)
    block = FORMATS[fmt].block
    wide = random_quantized(fmt, 21, 4 * 256, g)
    weight = wide.narrow_cols(block * (256 // block), 2 * 256)
    x = torch.randn(3, 2 * 256, generator=g)
    out = torch.full((3, 30), float("nan"))
    y = kernels.quant_linear_q8(x, weight, out=out[:, 5:26])
    assert y is not None
    check(out[:, 5:26], x, weight.dequantize())
    assert torch.isnan(out[:, :5]).all() and torch.isnan(out[:, 26:]).all()


@pytest.mark.parametrize("fmt", ("q4_k", "q6_k", "q8_0", "q4_0"))
@pytest.mark.parametrize("threads", (1, 2, 3))
def test_team_variant(kernels: NativeKernels, fmt: str, threads: int) -> None:
    """quire_quant_rows_q8_team run by every thread of a team (a harness's)."""
    g = torch.Generator().manual_seed(200 + threads)
    weight = random_quantized(fmt, 50, 512, g)
    bias = torch.randn(50, generator=g)
    for m in (1, 3):
        x = torch.randn(m, 512, generator=g)
        y = kernels.quant_linear_q8(x, weight, bias, team_threads=threads)
        assert y is not None
        check(y, x, weight.dequantize(), bias)
        one = kernels.quant_linear_q8(x, weight, bias)
        torch.testing.assert_close(y, one, rtol=0, atol=0)


def test_formats_it_does_not_take(kernels: NativeKernels) -> None:
    """Another format: a distinct code (4) from the entry, None from the wrapper; a width
    that is not whole blocks: code 2."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(1, 256, generator=g)
    y = torch.empty(1, 4)
    for fmt in ("q2_k", "q3_k", "f32", "f16", "bf16", "int8"):
        weight = random_quantized(fmt, 4, 256, g)
        assert not kernels.quant_q8_fits(weight)
        assert kernels.quant_linear_q8(x, weight) is None
        data = weight.data
        code = kernels._quant_q8(FORMATS[fmt].id, x.data_ptr(), 1, 256, data.data_ptr(),
                                 data.stride(0), 4, None, y.data_ptr(), 4)
        assert code == NativeKernels.QUANT_Q8_UNSUPPORTED == 4
    code = kernels._quant_q8(FORMATS["q4_k"].id, x.data_ptr(), 1, 128, ctypes.c_void_p(0), 0, 4,
                             None, y.data_ptr(), 4)
    assert code == 2
    assert not kernels._quant_q8_fits(FORMATS["q4_k"].id, 128)
    assert kernels._quant_q8_fits(FORMATS["q4_0"].id, 96)
