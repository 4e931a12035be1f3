"""RMSNorm in C (quire/platforms/cpu/native_norm.py) against a float64 oracle, and its
installation on a model.

Tolerance: float32 ``rtol = atol = 1e-5`` against float64 (only the order of the sum
of squares differs from torch's float32 path; ~1e-7 seen). Inputs are seeded N(0, 1)
with a scale, never zeros.
"""

from __future__ import annotations


import pytest
import torch

from quire.models.layers.norm import RMSNorm
from quire.platforms.cpu.native import NativeKernels
from quire.platforms.cpu.native_norm import NativeRMSNorm, install_norm_kernels


def _oracle(x, weight, eps, residual=None):
    h = x.double() if residual is None else residual.double() + x.double()
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight.double() * normed, h


@pytest.mark.parametrize("shape", [(1, 576), (3, 64), (40, 96), (2, 5, 37), (1, 5)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_matches_float64(kernels: NativeKernels, shape: tuple[int, ...],
                         with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=gen) * 3
    weight = torch.randn(shape[-1], generator=gen)
    residual = torch.randn(shape, generator=gen) if with_residual else None
    got = kernels.rms_norm(x, weight, 1e-5, residual)
    expected, h = _oracle(x, weight, 1e-5, residual)
    if with_residual:
        got, new_residual = got
        assert new_residual.shape == x.shape
        torch.testing.assert_close(new_residual.double(), h, rtol=1e-6, atol=1e-6)
    assert got.shape == x.shape and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


def test_declines_what_it_does_not_take(kernels: NativeKernels) -> None:
    x, weight = torch.randn(2, 8), torch.randn(8)
    assert kernels.rms_norm(x.double(), weight, 1e-6) is None
    assert kernels.rms_norm(x, weight.double(), 1e-6) is None
    assert kernels.rms_norm(x, torch.randn(7), 1e-6) is None
    assert kernels.rms_norm(x, weight, 1e-6, residual=torch.randn(3, 8)) is None
    assert kernels.rms_norm(x, weight, 1e-6, residual=torch.randn(2, 8).double()) is None
    strided = torch.randn(8, 2)[:, 0].view(1, 8)  # made contiguous, not refused
    torch.testing.assert_close(kernels.rms_norm(strided, weight, 1e-6).double(),
                               _oracle(strided, weight, 1e-6)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("with_residual", [False, True])
def test_installed_norm_agrees_with_the_modules_torch_path(kernels: NativeKernels,
                                                           with_residual: bool) -> None:
    model = torch.nn.Sequential(RMSNorm(48, eps=1e-6), RMSNorm(48, eps=1e-6))
    for norm in model:
        norm.weight.data = torch.randn(48)
    x, residual = torch.randn(4, 48), torch.randn(4, 48) if with_residual else None
    expected = [norm(x, residual) for norm in model]
    assert install_norm_kernels(model, kernels) == 2
    assert all(isinstance(norm.kernel, NativeRMSNorm) for norm in model)
    for norm, want in zip(model, expected):
        got = norm(x, residual)
        if with_residual:
            torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)  # the same one add
            got, want = got[0], want[0]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("with_residual", [False, True])
def test_an_offset_norm_agrees_with_its_torch_path(kernels: NativeKernels,
                                                   with_residual: bool) -> None:
    """Gemma's ``(1 + weight)``: the site publishes its offset, the kernel adds it once."""
    norm = RMSNorm(48, eps=1e-6, offset=1.0)
    norm.weight.data = torch.randn(48) * 0.1
    x, residual = torch.randn(4, 48), torch.randn(4, 48) if with_residual else None
    want = norm(x, residual)
    assert install_norm_kernels(torch.nn.Sequential(norm), kernels) == 1
    got = norm(x, residual)
    if with_residual:
        got, want = got[0], want[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_modules_that_publish_no_site_and_other_dtypes_keep_the_torch_path(
        kernels: NativeKernels) -> None:
    class OtherNorm(RMSNorm):  # computes something else: says it is no rms_norm site
        op_site = None

    model = torch.nn.Sequential(OtherNorm(8), RMSNorm(8).to(torch.bfloat16))
    assert install_norm_kernels(model, kernels) == 0
    assert all(norm.kernel is None for norm in model)
