"""The Triton RMSNorm (with residual add, with Gemma's offset) and gated-activation kernels
against the torch reference ops, in Triton's interpreter on CPU tensors.

Inputs are seeded random (never zeros); shapes cover one row, many rows, hidden sizes
that are not powers of two (odd ones too), rows that are not contiguous (a head view of
a fused q/k projection), and leading dimensions of more than one.

Tolerances, against :mod:`quire.ops.reference` in the same dtype, from the same inputs:

- float32: rtol = atol = 1e-5. The kernels take the same steps in float32; sums in
  another order and ``exp``/``rsqrt`` that differ in the last bit cost about 1e-6.
- float16 and bfloat16: one unit in the last place of outputs of order 1-10
  (float16 8e-3, bfloat16 6.3e-2), with rtol of one unit (2**-10, 2**-7). The kernels round
  where the reference rounds, so most elements are equal bit for bit; a float32
  intermediate that differs in its last bit may round to the neighbouring value. The
  residual sum is a single rounded add on both sides: it must be equal bit for bit.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from quire.ops import reference  # noqa: E402

TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (8e-3, 2**-10),
             torch.bfloat16: (6.3e-2, 2**-7)}
DTYPES = tuple(TOLERANCE)


def ops():
    from quire.kernels import triton_fused, triton_ops

    assert triton_fused.INTERPRETED
    return triton_ops


def close(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype
    atol, rtol = TOLERANCE[want.dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


def norm_case(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, generator=g) * 2).to(dtype)
    residual = torch.randn(*shape, generator=g).to(dtype)
    weight = (1 + 0.2 * torch.randn(shape[-1], generator=g)).to(dtype)
    return x, residual, weight


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 7), (19, 96), (3, 5, 33), (4, 1000)])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_matches_the_reference(shape, dtype, offset):
    x, residual, weight = norm_case(shape, dtype, seed=shape[-1])
    close(ops().rms_norm(x, weight, 1e-6, offset=offset),
          reference.rms_norm(x, weight, 1e-6, offset=offset))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (17, 130), (2, 3, 7)])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_with_residual_returns_the_norm_and_the_exact_sum(shape, dtype, offset):
    x, residual, weight = norm_case(shape, dtype, seed=7 * shape[-1])
    got, got_sum = ops().rms_norm(x, weight, 1e-5, residual, offset=offset)
    want, want_sum = reference.rms_norm(x, weight, 1e-5, residual, offset=offset)
    close(got, want)
    assert torch.equal(got_sum, want_sum)
    assert got_sum.data_ptr() not in (x.data_ptr(), residual.data_ptr())  # inputs kept


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_of_head_views_of_a_fused_projection(dtype):
    """q/k norm (Qwen3, Gemma 3) normalises [T, H, D] views whose rows are not evenly
    strided."""
    g = torch.Generator().manual_seed(5)
    qk = torch.randn(6, 4 + 2, 24, generator=g).to(dtype)
    q, k = qk.split([4, 2], dim=1)
    weight = torch.rand(24, generator=g).to(dtype)
    for part in (q, k, qk[:, :, :]):
        close(ops().rms_norm(part, weight, 1e-6), reference.rms_norm(part, weight, 1e-6))


def test_rms_norm_of_no_rows_and_refusals():
    weight = torch.ones(8)
    assert ops().rms_norm(torch.empty(0, 8), weight, 1e-6).shape == (0, 8)
    with pytest.raises(ValueError, match="weight of shape"):
        ops().rms_norm(torch.randn(2, 8), torch.ones(9), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        ops().rms_norm(torch.randn(2, 8), weight, 1e-6, torch.randn(2, 8).double())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2 * 5), (23, 2 * 96), (2, 3, 2 * 33), (3, 2 * 1500)])
@pytest.mark.parametrize("op", ["silu_and_mul", "gelu_tanh_and_mul"])
def test_gated_activations_match_the_reference(op, shape, dtype):
    g = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)  # gates well into both tails
    close(getattr(ops(), op)(x), getattr(reference, op)(x))


def test_gated_activation_of_extreme_gates_stays_finite():
    x = torch.tensor([[-200.0, -30.0, 0.0, 30.0, 200.0] + [1.0] * 5])
    for op in ("silu_and_mul", "gelu_tanh_and_mul"):
        got, want = getattr(ops(), op)(x), getattr(reference, op)(x)
        assert torch.isfinite(got).all()
        close(got, want)


def test_gated_activation_refuses_an_odd_width():
    with pytest.raises(ValueError, match="odd"):
        ops().silu_and_mul(torch.randn(2, 7))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_many_rows_and_model_sized_rows(dtype):
    """Sizes of real models: SmolLM2's hidden 576 and MLP 1536 over 256 rows; a 4096
    hidden; 2048 rows of a head (per-head norm). About a minute per dtype, interpreted."""
    for shape in ((256, 576), (16, 4096), (2048, 64)):
        x, residual, weight = norm_case(shape, dtype, seed=shape[0])
        got = ops().rms_norm(x, weight, 1e-6, residual)
        want = reference.rms_norm(x, weight, 1e-6, residual)
        close(got[0], want[0])
        assert torch.equal(got[1], want[1])
    x = torch.randn(256, 2 * 1536, generator=torch.Generator().manual_seed(1)).to(dtype)
    close(ops().silu_and_mul(x), reference.silu_and_mul(x))
    close(ops().gelu_tanh_and_mul(x), reference.gelu_tanh_and_mul(x))


def test_importing_the_ops_does_not_import_triton():
    import json
    import subprocess
    import sys

    probe = ("import json, sys; import quire.kernels.triton_ops; "
             "print(json.dumps([m for m in sys.modules if m.split('.')[0] == 'triton']))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == []


def test_the_gpu_platforms_take_these_ops():
    from quire.kernels import triton_ops
    from quire_cuda.platform import CudaPlatform
    from quire_rocm.platform import RocmPlatform

    for platform in (CudaPlatform(), RocmPlatform()):
        made = platform.make_ops()
        for name in ("rms_norm", "silu_and_mul", "gelu_tanh_and_mul"):
            assert getattr(made, name) is getattr(triton_ops, name)
            assert made.source_of(name) == "triton"
        assert made.source_of("layer_norm") == "reference"


@pytest.mark.parametrize("platform_name", ["cuda", "rocm"])
def test_conformance_layer_ops_row_passes_in_kernels_only_mode(platform_name):
    """The suite's layer-ops check, as ``quire conformance --device cuda --kernels-only``
    runs it (and the same for rocm)."""
    from quire.conformance import ConformanceOptions, Outcome, run_conformance
    from quire_cuda.platform import CudaPlatform
    from quire_rocm.platform import RocmPlatform

    platform = {"cuda": CudaPlatform, "rocm": RocmPlatform}[platform_name]()
    options = ConformanceOptions(kernels_only=True, checks=("layer-ops",))
    rows = run_conformance(platform, options, expected_name=platform_name).results
    assert len(rows) == len(platform.supported_dtypes)
    for row in rows:
        assert row.outcome is Outcome.PASS, f"{row.case}: {row.reason}"
        assert "rms_norm: triton, silu_and_mul: triton, gelu_tanh_and_mul: triton" \
            in row.figure
