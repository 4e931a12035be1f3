"""The Triton RMSNorm (with residual add, with Gemma's offset), gated-activation and
rotary-with-KV-write kernels against the torch reference ops, in Triton's interpreter on
CPU tensors.

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
  The rotation rounds three times on both sides (two products, their sum); values are
  copied into the cache, bit for bit.
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


def rotary_case(t, hq, hkv, d, dtype, seed, num_blocks=4, block_size=4):
    """Views as the models make them: q/k heads and values split from one projection,
    cos/sin halves of one table row; a cache of random contents (what is not written
    must stay as it was); distinct random slots."""
    from quire.models.layers.rotary import RotaryEmbedding, default_inv_freq

    g = torch.Generator().manual_seed(seed)
    table = RotaryEmbedding(d, default_inv_freq(10000.0, d), max_position=512)
    cos, sin = table(torch.randint(0, 512, (t,), generator=g), dtype)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype)
    qk, v = qkv.split([(hq + hkv) * d, hkv * d], dim=-1)
    cache = torch.randn(2, num_blocks, block_size, hkv, d, generator=g).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:t]
    return qk.view(t, hq + hkv, d), v.view(t, hkv, d), cos, sin, cache, slots


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t, hq, hkv, d", [
    (1, 2, 1, 8),       # one token
    (9, 4, 2, 64),      # GQA
    (13, 3, 3, 18),     # no GQA; D/2 odd, D not a power of two
    (16, 8, 1, 32),     # every slot of the cache written
])
def test_rotary_write_kv_matches_the_reference(t, hq, hkv, d, dtype):
    qk, v, cos, sin, cache, slots = rotary_case(t, hq, hkv, d, dtype, seed=t + d)
    want_cache = cache.clone()
    want = reference.rotary_write_kv(qk, v, cos, sin, want_cache, slots)
    got = ops().rotary_write_kv(qk, v, cos, sin, cache, slots)
    close(got, want)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(cache, want_cache, atol=atol, rtol=rtol)
    assert torch.equal(cache[1], want_cache[1])  # values are copied, not computed


def test_rotary_write_kv_skips_padding_slots_and_keeps_its_inputs():
    qk, v, cos, sin, cache, _ = rotary_case(3, 2, 1, 16, torch.float32, seed=2)
    before, qk_before = cache.clone(), qk.clone()
    slots = torch.tensor([5, -1, 0])
    q = ops().rotary_write_kv(qk, v, cos, sin, cache, slots)
    want_cache = before.clone()
    reference.rotary_write_kv(qk[[0, 2]], v[[0, 2]], cos[[0, 2]], sin[[0, 2]], want_cache,
                              slots[[0, 2]])
    close(cache, want_cache)
    close(q, reference.rotary_write_kv(qk, v, cos, sin, before.clone(), slots.abs()))
    assert torch.equal(qk, qk_before)


def test_rotary_write_kv_refuses_mismatched_shapes_by_name():
    qk, v, cos, sin, cache, slots = rotary_case(2, 2, 1, 8, torch.float32, seed=0)
    with pytest.raises(ValueError, match="kv_cache"):
        ops().rotary_write_kv(qk, v, cos, sin, cache[:, :, :, :, :4], slots)
    with pytest.raises(ValueError, match="share one dtype"):
        ops().rotary_write_kv(qk, v, cos, sin, cache.double(), slots)
    with pytest.raises(ValueError, match="cos"):
        ops().rotary_write_kv(qk, v, cos[:1], sin, cache, slots)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_many_rows_and_model_sized_rows(dtype):
    """Sizes of real models: SmolLM2's hidden 576 and MLP 1536 over 256 rows; a 4096
    hidden; 2048 rows of a head (per-head norm). About ten seconds per dtype, interpreted."""
    for shape in ((256, 576), (16, 4096), (2048, 64)):
        x, residual, weight = norm_case(shape, dtype, seed=shape[0])
        got = ops().rms_norm(x, weight, 1e-6, residual)
        want = reference.rms_norm(x, weight, 1e-6, residual)
        close(got[0], want[0])
        assert torch.equal(got[1], want[1])
    x = torch.randn(256, 2 * 1536, generator=torch.Generator().manual_seed(1)).to(dtype)
    close(ops().silu_and_mul(x), reference.silu_and_mul(x))
    close(ops().gelu_tanh_and_mul(x), reference.gelu_tanh_and_mul(x))
    qk, v, cos, sin, cache, slots = rotary_case(256, 32, 8, 128, dtype, seed=3,
                                                num_blocks=32, block_size=16)
    want_cache = cache.clone()
    close(ops().rotary_write_kv(qk, v, cos, sin, cache, slots),
          reference.rotary_write_kv(qk, v, cos, sin, want_cache, slots))
    close(cache, want_cache)


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
        for name in ("rms_norm", "silu_and_mul", "gelu_tanh_and_mul", "rotary_write_kv"):
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
