"""The panel GEMM (csrc/panel_gemm.c) for products of a few rows, against float64.

Tolerance: float32 ``rtol = atol = 1e-5`` relative to the output's largest magnitude
(one float32 sum along K per output, in order; ~1e-7 seen). Inputs are seeded
N(0, 1), never zeros. Shapes cover every row tile (1-6 rows and tails past 6, rows read
in place and, from 128 rows on, packed first), column counts that are not a multiple of
the 16-wide panel, K below the 4-way unroll of the one-row tile, and every group the
AVX-512 tile walks a thread's panels in (4, 2 and 1 panels: N a multiple of 64, 32 + 16,
below 16), on teams of 1 to 3 threads (each takes a share of the panels)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from native_builds import no_panels_reason
from quire.platforms.cpu.native import NativeKernels
from quire.platforms.cpu.packed_linear import PackedLinear


@pytest.fixture(autouse=True)
def _needs_panel_kernel(kernels: NativeKernels) -> None:
    if not kernels.has_panel_gemm:
        pytest.skip(no_panels_reason(kernels))


def _close(got: torch.Tensor, expected: torch.Tensor) -> None:
    scale = expected.abs().max().clamp_min(1e-30)
    torch.testing.assert_close(got.double() / scale, expected / scale, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [*range(1, 14), 64, 127, 128, 131, 300, 1031])
@pytest.mark.parametrize(("out_features", "in_features"),
                         [(1, 1), (8, 20), (16, 3), (17, 8), (100, 37), (48, 576),
                          (64, 40), (80, 24), (128, 5), (200, 19)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_float64(kernels: NativeKernels, rows: int, out_features: int,
                         in_features: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + out_features + in_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    x = torch.randn(rows, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    panels = kernels.pack_panels(weight)
    assert panels.shape == (-(-out_features // 16), in_features, 16)
    got = kernels.panel_linear(x, panels, out_features, bias)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    _close(got, F.linear(x.double(), weight.double(),
                         None if bias is None else bias.double()))


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("num_panels", range(1, 12))
@pytest.mark.parametrize("rows", [1, 5, 6, 13, 131])
def test_every_share_of_panels(kernels: NativeKernels, threads: int, num_panels: int,
                               rows: int) -> None:
    """Each thread's share, from 0 panels (more threads than panels) to 11: every mix of
    4-, 2- and 1-panel groups; the last panel 9 columns wide."""
    out_features, in_features = 16 * num_panels - 7, 33
    gen = torch.Generator().manual_seed(num_panels * 100 + rows)
    weight = torch.randn(out_features, in_features, generator=gen)
    x = torch.randn(rows, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = kernels.panel_linear(x, kernels.pack_panels(weight), out_features, bias)
    finally:
        torch.set_num_threads(before)
    _close(got, F.linear(x.double(), weight.double(), bias.double()))


def test_declines_what_it_does_not_take(kernels: NativeKernels) -> None:
    weight = torch.randn(20, 8)
    panels = kernels.pack_panels(weight)
    assert kernels.panel_linear(torch.randn(2, 8).double(), panels, 20, None) is None
    assert kernels.panel_linear(torch.randn(2, 9), panels, 20, None) is None
    assert kernels.panel_linear(torch.randn(2, 8), panels, 33, None) is None  # 2 panels
    assert kernels.panel_linear(torch.randn(2, 8), panels, 20, torch.randn(20).double()) is None
    strided = torch.randn(2, 16)[:, ::2]  # made contiguous, not refused
    _close(kernels.panel_linear(strided, panels, 20, None),
           F.linear(strided.double(), weight.double()))


def test_packed_linear_routes_by_rows(kernels: NativeKernels, monkeypatch) -> None:
    """Every product on the panels, read in place or packed; no oneDNN copy kept."""
    weight, bias = torch.randn(40, 24), torch.randn(40)
    linear = PackedLinear(weight, kernels)
    assert linear.panels is not None and linear.split is None and linear.packed is None
    calls = []
    real = kernels.panel_linear
    monkeypatch.setattr(kernels, "panel_linear",
                        lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    for rows in (1, 5, 256, 2049):
        x = torch.randn(rows, 24)
        _close(linear(x, bias), F.linear(x.double(), weight.double(), bias.double()))
    assert calls == [1, 5, 256, 2049]
    with pytest.raises(ValueError, match="float32 host input"):
        linear(torch.randn(3, 24).double(), bias)
