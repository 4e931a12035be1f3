"""Quantised KV pages (``quire.ops.kv_quant``): the write/read round trip, the layout,
the cpu backend against the reference on the same pages, and the refusals at start."""

from __future__ import annotations

import pytest
import torch
from quire.config import EngineConfig
from quire.conformance.cases import NUM_KV_HEADS, SHAPES, make_case
from quire.interfaces.attention import check_kv_cache_dtype
from quire.ops import kv_quant
from quire.ops.attention import ReferenceAttentionBackend
from quire.ops.reference import rotary_write_kv
from quire.platforms.cpu.platform import CpuPlatform

QUANT = [torch.int8, torch.float8_e4m3fn]


@pytest.mark.parametrize("dtype", QUANT)
def test_round_trip_within_half_a_step_and_the_scales_beside_the_row(dtype):
    """A float16 scale per 16 values after each row: absmax / qmax of its group, rounded
    (1 for an all-zero group, at most 65504); every value back within half a step of its
    group's grid."""
    x = torch.randn(50, 3, 64) * torch.logspace(-3, 2, 50)[:, None, None]
    x[7, 1] = 0.0  # a zero vector: scales 1, values 0
    x[8, 2, 16:32] = 0.0  # one zero group
    x[9, 0, 40] = 1e9  # a group whose scale is capped
    rows = kv_quant.quantize(x, dtype).view(dtype)
    assert rows.shape == (50, 3, 72)
    scale = rows[..., 64:].view(torch.float16)
    assert scale.shape == (50, 3, 4)
    qmax = kv_quant.QMAX[dtype]
    groups = x.view(50, 3, 4, 16)
    back = kv_quant.dequantize(rows).view(50, 3, 4, 16)
    if dtype == torch.int8:  # int8 groups are quantised in the Hadamard basis
        groups, back = kv_quant.hadamard16(groups), kv_quant.hadamard16(back)
    want = (groups.abs().amax(-1) / qmax).clamp(max=65504).half()
    want[want == 0] = 1.0
    assert torch.equal(scale, want)
    assert scale[7, 1].eq(1).all() and scale[8, 2, 1] == 1 and scale[9, 0, 2] == 65504
    assert torch.equal(kv_quant.dequantize(rows)[7, 1], torch.zeros(64))
    s = scale.float()[..., None]  # per group
    if dtype == torch.int8:
        bound = (s / 2).expand(50, 3, 4, 16)
    else:  # 3 mantissa bits: half a step is 2**-4 of the value; subnormals step 2**-9
        bound = torch.maximum(groups.abs() * 2.0**-4, s * 2.0**-10)
    err = (back - groups).abs()
    err[9, 0, 2] = 0.0  # the capped group saturates (1e9 / 65504 > qmax)
    assert (err <= bound * 1.0001 + 1e-30).all()
    assert rows[..., :64].float().abs().max() <= qmax


def test_hadamard16_is_the_orthonormal_sylvester_matrix_and_its_own_inverse():
    h = torch.ones(1, 1)
    while h.shape[0] < 16:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    x = torch.randn(5, 3, 16)
    assert torch.allclose(kv_quant.hadamard16(x), x @ (h / 4), atol=1e-6)
    assert torch.allclose(kv_quant.hadamard16(kv_quant.hadamard16(x)), x, atol=1e-6)


def test_int8_groups_with_an_outlier_keep_a_fine_grid_for_the_rest():
    """Keys carry outlier channels: in the plain basis one large value sets its group's
    step for the other 15, while in the Hadamard basis (what int8 pages store) it is spread
    over all 16 and the read-back error of the group is several times smaller (fp8's error
    is relative to each value, so it keeps the plain basis)."""
    torch.manual_seed(0)
    x = torch.randn(4096, 1, 16)
    x[:, 0, 3] = 40.0 * torch.sign(torch.randn(4096))
    got = kv_quant.dequantize(kv_quant.quantize(x, torch.int8).view(torch.int8))
    plain = x.abs().amax(-1, keepdim=True) / 127
    plain_back = (x / plain).round() * plain
    others = [i for i in range(16) if i != 3]
    rotated_mse = (got - x)[..., others].square().mean()
    plain_mse = (plain_back - x)[..., others].square().mean()
    assert rotated_mse < plain_mse / 4


@pytest.mark.parametrize("dtype", QUANT)
def test_writes_land_in_their_slots_only(dtype):
    ref = ReferenceAttentionBackend()
    cache = ref.allocate_kv_cache(4, 4, 2, 16, dtype, torch.device("cpu"))
    assert cache.shape == (2, 4, 4, 2, 18) and cache.dtype == dtype
    cache.view(torch.uint8).fill_(0x11)
    before = cache.view(torch.uint8).clone()
    key, value = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    slots = torch.tensor([5, 0, 14])
    kv_quant.write_kv(cache, slots, key, value)
    after = cache.view(torch.uint8).view(2, 16, 2, 18)
    untouched = [s for s in range(16) if s not in (5, 0, 14)]
    assert torch.equal(after[:, untouched], before.view(2, 16, 2, 18)[:, untouched])
    got = kv_quant.dequantize(cache.view(2, 16, 2, 18)[:, slots])
    assert (got[0] - key).abs().max() < 0.2 and (got[1] - value).abs().max() < 0.2


@pytest.mark.parametrize("dtype", QUANT)
def test_rotary_write_kv_quantises_what_write_kv_would(dtype):
    qk, value = torch.randn(5, 6, 16), torch.randn(5, 2, 16)
    cos, sin = torch.randn(5, 1, 16), torch.randn(5, 1, 16)
    a = torch.zeros(2, 3, 4, 2, 18, dtype=dtype)
    b = a.clone()
    slots = torch.tensor([1, 2, 3, 7, 11])
    q = rotary_write_kv(qk, value, cos, sin, a, slots)
    rotated = qk * cos + qk.roll(8, dims=-1) * sin
    assert torch.equal(q, rotated[:, :4])
    kv_quant.write_kv(b, slots, rotated[:, 4:], value)
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", QUANT)
@pytest.mark.parametrize("kind", list(SHAPES))
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_cpu_backend_matches_the_reference_on_quantised_pages(dtype, kind, model_dtype):
    """The cpu platform's backend (C kernels loaded: they write and read int8/fp8 pages,
    where a bfloat16 model's steps take the torch path) against the reference, same
    pages, NaN-poisoned where unwritten."""
    case = make_case(SHAPES[kind](4), 4, 32, 2, model_dtype, 3)
    outs = []
    for backend in (ReferenceAttentionBackend(), CpuPlatform().make_attention_backend()):
        cache = backend.allocate_kv_cache(case.num_blocks, 4, NUM_KV_HEADS, 32, dtype,
                                          torch.device("cpu"))
        cache.view(torch.uint8).fill_(0x7F)
        if case.prefix_batch is not None:
            backend.write_kv(case.prefix_key, case.prefix_value, cache,
                             backend.build_metadata(case.prefix_batch))
        outs.append(backend.forward(case.query, case.key, case.value, cache,
                                    backend.build_metadata(case.batch), scale=0.2,
                                    sliding_window=5).float())
    tol = 1e-5 if model_dtype == torch.float32 else 2e-2
    assert torch.isfinite(outs[1]).all()
    torch.testing.assert_close(outs[1], outs[0], atol=tol, rtol=tol)


def test_bytes_per_page_count_values_and_scales():
    backend = CpuPlatform().make_attention_backend()
    f32 = backend.kv_cache_bytes(1, 16, 8, 64, torch.float32)
    i8 = backend.kv_cache_bytes(1, 16, 8, 64, torch.int8)
    assert f32 == 2 * 16 * 8 * 64 * 4 and i8 == 2 * 16 * 8 * 72
    assert backend.kv_cache_bytes(1, 16, 8, 64, torch.float8_e4m3fn) == i8
    assert f32 / i8 == pytest.approx(3.56, abs=0.01)


def test_kv_cache_dtype_option_is_checked():
    assert EngineConfig(model="m", kv_cache_dtype="fp8").kv_cache_dtype == "fp8"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto"):
        EngineConfig(model="m", kv_cache_dtype="fp8_e5m2")


class _OldBackend(ReferenceAttentionBackend):
    """A plugin's backend from before ``kv_cache_dtypes``: it declares nothing."""

    name = "old"
    kv_cache_dtypes = ()


def test_a_backend_refuses_what_it_does_not_declare_in_one_line():
    old = _OldBackend()
    assert check_kv_cache_dtype(old, "vendor", "auto", torch.bfloat16, 64) == torch.bfloat16
    # the model's own dtype by name is auto
    assert check_kv_cache_dtype(old, "vendor", "bfloat16", torch.bfloat16, 64) \
        == torch.bfloat16
    with pytest.raises(ValueError) as err:
        check_kv_cache_dtype(old, "vendor", "int8", torch.bfloat16, 64)
    assert str(err.value) == ("kv_cache_dtype: int8 is not supported by the 'vendor' "
                              "platform's attention backend (old); supported: auto")
    cpu = CpuPlatform().make_attention_backend()
    assert check_kv_cache_dtype(cpu, "cpu", "fp8", torch.float32, 64) == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="multiple of 16"):
        check_kv_cache_dtype(cpu, "cpu", "int8", torch.float32, 72)


class _PlainInt8Backend(_OldBackend):
    """A backend of plugin API 1.3-1.5 that wrote and read int8 pages itself, in the plain
    basis (one that takes the reference's write and read inherits the flag with them)."""

    name = "plain-int8"
    kv_cache_dtypes = ("int8", "fp8")
    kv_int8_hadamard = False


def test_int8_pages_of_the_layout_before_api_1_6_are_refused_at_start():
    """Such a backend's pages would be read in the Hadamard basis by the op set's reference
    (and written in it by its rotary_write_kv): refused int8 in one line; its fp8 stays."""
    plain = _PlainInt8Backend()
    assert check_kv_cache_dtype(plain, "vendor", "fp8", torch.float32, 64) \
        == torch.float8_e4m3fn
    with pytest.raises(ValueError) as err:
        check_kv_cache_dtype(plain, "vendor", "int8", torch.float32, 64)
    assert str(err.value).startswith("kv_cache_dtype: int8 pages of the 'vendor' platform's "
                                     "attention backend (plain-int8) are of the layout "
                                     "before plugin API 1.6")
    assert "\n" not in str(err.value)
    for backend in (ReferenceAttentionBackend(), CpuPlatform().make_attention_backend()):
        assert check_kv_cache_dtype(backend, "cpu", "int8", torch.float32, 64) == torch.int8
