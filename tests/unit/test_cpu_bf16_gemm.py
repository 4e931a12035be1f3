"""The bfloat16 pair-panel GEMM (csrc/panel_bf16.c, the avx512_bf16 level) against
float64 on the same bfloat16 values.

Tolerance: float32 output within ``4 (K + 1) 2^-24`` of ``|x| |W|^T + |bias|`` per
element (float32 sums of K exact bf16 products, as vdpbf16ps adds them, two at a
time, then the bias); bfloat16 output that, plus one bfloat16 rounding (``2^-8`` of the value).
Inputs are seeded N(0, 1). Shapes cover every row tile (1-6 rows and tails), odd K
(a zero pads the last pair), N that is not a multiple of the 16-wide panel, and every
panel group (4, 2 and 1) on teams of 1 to 3 threads. Float32 rows rounded on the way
in (the fused layer's use) are covered by tests/unit/test_cpu_fused_decode.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from quire.platforms.cpu.native import NativeKernels
from quire.platforms.cpu.packed_linear import PackedLinear


@pytest.fixture(autouse=True)
def _needs_bf16_kernel(kernels: NativeKernels) -> None:
    if not kernels.has_bf16_gemm:
        pytest.skip(f"level {kernels.level} has no bfloat16 pair-panel kernel")


def _check(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
           bias: torch.Tensor | None) -> None:
    xd, wd = x.double(), weight.double()
    expected = F.linear(xd, wd, None if bias is None else bias.double())
    k = x.shape[1]
    magnitude = xd.abs() @ wd.abs().T + (0 if bias is None else bias.double().abs())
    bound = 4 * (k + 1) * 2.0**-24 * magnitude + 1e-30
    if got.dtype == torch.bfloat16:
        bound = bound + 2.0**-8 * expected.abs()
    excess = ((got.double() - expected).abs() - bound).max().item()
    assert excess <= 0, f"over the bound by {excess}"


@pytest.mark.parametrize("rows", [*range(1, 14), 64, 131])
@pytest.mark.parametrize(("out_features", "in_features"),
                         [(1, 1), (8, 20), (16, 3), (17, 8), (100, 37), (48, 576),
                          (64, 41), (80, 24), (200, 19)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_matches_float64(kernels: NativeKernels, rows: int, out_features: int,
                         in_features: int, with_bias: bool, out_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + out_features + in_features)
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    panels = kernels.pack_bf16_panels(weight)
    assert panels.shape == (-(-out_features // 16), -(-in_features // 2), 16, 2)
    assert torch.equal(kernels.unpack_bf16_panels(panels, out_features, in_features), weight)
    got = kernels.bf16_linear(x, panels, out_features, bias, out_dtype)
    assert got.shape == (rows, out_features) and got.dtype == out_dtype
    _check(got, x, weight, bias)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("num_panels", range(1, 12))
@pytest.mark.parametrize("rows", [1, 5, 6, 13])
def test_every_share_of_panels(kernels: NativeKernels, threads: int, num_panels: int,
                               rows: int) -> None:
    """Each thread's share, from 0 panels (more threads than panels) to 11: every mix of
    4-, 2- and 1-panel groups; the last panel 9 columns wide."""
    out_features, in_features = 16 * num_panels - 7, 33
    gen = torch.Generator().manual_seed(num_panels * 100 + rows)
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    bias = torch.randn(out_features, generator=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = kernels.bf16_linear(x, kernels.pack_bf16_panels(weight), out_features, bias,
                                  torch.float32)
    finally:
        torch.set_num_threads(before)
    _check(got, x, weight, bias)


def test_declines_what_it_does_not_take(kernels: NativeKernels) -> None:
    weight = torch.randn(20, 8).bfloat16()
    panels = kernels.pack_bf16_panels(weight)
    assert kernels.bf16_linear(torch.randn(2, 8), panels, 20, None) is None  # float32 rows
    assert kernels.bf16_linear(torch.randn(2, 10).bfloat16(), panels, 20, None) is None
    assert kernels.bf16_linear(torch.randn(2, 8).bfloat16(), panels, 33, None) is None
    assert kernels.bf16_linear(torch.randn(2, 8).bfloat16(), panels, 20,
                               torch.randn(21)) is None
    assert kernels.bf16_linear(torch.randn(2, 8).bfloat16(), panels, 20, None,
                               torch.float64) is None
    strided = torch.randn(2, 16).bfloat16()[:, ::2]  # made contiguous, not refused
    _check(kernels.bf16_linear(strided, panels, 20, None, torch.float32), strided, weight,
           None)


def test_a_bfloat16_packed_linear_keeps_pair_panels_and_no_onednn_copy(
        kernels: NativeKernels) -> None:
    """Where the kernel is, a bfloat16 layer's products run on it at every row count
    (memory: the pair panels replace oneDNN's packed copy); ``use_onednn`` moves them
    (dispatch.py's choice on a host where oneDNN is faster)."""
    weight = torch.randn(40, 24).bfloat16()
    bias = torch.randn(40).bfloat16()
    linear = PackedLinear(weight, kernels)
    assert linear.panels is not None and linear.packed is None and linear.impl == "panels"
    assert torch.equal(linear.weight(), weight)
    for rows in (1, 7, 64):
        x = torch.randn(3, rows, 24).bfloat16()
        got = linear(x, bias)
        assert got.shape == (3, rows, 40) and got.dtype == torch.bfloat16
        _check(got.reshape(-1, 40), x.reshape(-1, 24), weight, bias.float())
    linear.use_onednn()
    assert linear.panels is None and linear.packed is not None and linear.impl == "onednn"
    x = torch.randn(5, 24).bfloat16()
    torch.testing.assert_close(linear(x, bias).float(), F.linear(x, weight, bias).float(),
                               rtol=2**-7, atol=1e-2)


@pytest.mark.parametrize("in_features", [24, 25])
def test_the_dispatch_runners_compute_the_product(kernels: NativeKernels,
                                                  in_features: int) -> None:
    """dispatch.py times both implementations through ``runner``: each computes the
    layer's product (oneDNN's on a copy packed from the pair panels, odd K included)."""
    weight = torch.randn(40, in_features).bfloat16()
    linear = PackedLinear(weight, kernels)
    x = torch.randn(6, in_features).bfloat16()
    for impl in ("panels", "onednn"):
        _check(linear.runner(impl)(x), x, weight, None)
