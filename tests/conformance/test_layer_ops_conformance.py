"""The conformance suite's layer-ops check: the cpu platform passes, and broken ops fail
with a reason that names the op and the case. (The Triton kernels' rows, in the
interpreter, are in ``tests/kernels/test_triton_fused.py``.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from quire.conformance import ConformanceOptions, Outcome, run_conformance
from quire.ops import reference, reference_ops
from quire.platforms.cpu.platform import CpuPlatform

ONLY_LAYER_OPS = ConformanceOptions(checks=("layer-ops",))


def _with_ops(**ops):
    class Patched(CpuPlatform):
        def make_ops(self):
            return reference_ops().with_ops("broken", **ops)

    return Patched()


def test_cpu_platform_passes_every_declared_dtype():
    platform = CpuPlatform()
    rows = run_conformance(platform, ONLY_LAYER_OPS).results
    assert [r.case for r in rows] == [str(d).removeprefix("torch.")
                                      for d in platform.supported_dtypes]
    for row in rows:
        assert row.outcome is Outcome.PASS, row.reason
        assert "rms_norm: reference" in row.figure and "14 cases" in row.figure


def _offset_ignored(x, weight, eps, residual=None, *, offset=0.0):
    return reference.rms_norm(x, weight, eps, residual)


def _stale_residual(x, weight, eps, residual=None, *, offset=0.0):
    # the right norm, but the residual stream handed back unchanged
    out = reference.rms_norm(x, weight, eps, residual, offset=offset)
    return out if residual is None else (out[0], residual)


def _eps_outside_the_root(x, weight, eps, residual=None, *, offset=0.0):
    # 1 / (sqrt(mean) + eps): a common slip, visible on rows of small values only at
    # a large eps; here eps is large enough to show
    return reference.rms_norm(x, weight, eps + 1e-2, residual, offset=offset)


def _half_precision_sum(x, weight, eps, residual=None, *, offset=0.0):
    # every norm's statistics in bfloat16: what a kernel without a float32 upcast gets
    return reference.rms_norm(x.bfloat16().float(), weight, eps, residual, offset=offset)


def _exact_gelu(x):
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate) * up


def _swapped_halves(x):
    up, gate = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def _unrotated_keys(qk, value, cos, sin, kv_cache, slot_mapping):
    q = reference.rotary_write_kv(qk, value, cos, sin, kv_cache, slot_mapping)
    pages = kv_cache.view(2, -1, *kv_cache.shape[3:])
    pages[0].index_copy_(0, slot_mapping, qk[:, q.shape[1]:])
    return q


def _values_not_written(qk, value, cos, sin, kv_cache, slot_mapping):
    keep = kv_cache[1].clone()
    q = reference.rotary_write_kv(qk, value, cos, sin, kv_cache, slot_mapping)
    kv_cache[1].copy_(keep)
    return q


def _next_slot(qk, value, cos, sin, kv_cache, slot_mapping):
    slots = (slot_mapping + 1) % (kv_cache.shape[1] * kv_cache.shape[2])
    return reference.rotary_write_kv(qk, value, cos, sin, kv_cache, slots)


def _interleaved_pairs(qk, value, cos, sin, kv_cache, slot_mapping):
    # GPT-J's rotation (pairs 2i, 2i + 1) where the models use rotate-half (i, i + D/2)
    d = qk.shape[-1]
    perm = torch.arange(d).view(2, d // 2).t().reshape(-1)
    inv = torch.argsort(perm)
    q = reference.rotary_write_kv(qk[..., perm], value, cos[..., perm], sin[..., perm],
                                  kv_cache, slot_mapping)
    pages = kv_cache.view(2, -1, *kv_cache.shape[3:])
    pages[0][slot_mapping] = pages[0][slot_mapping][..., inv]
    return q[..., inv]


@pytest.mark.parametrize("ops, words", [
    ({"rms_norm": _offset_ignored}, "rms_norm, T=5, H=99, residual=True, offset=1: "),
    ({"rms_norm": _stale_residual}, "rms_norm, T=37, H=576, residual=True, offset=0 "
                                      "(the residual sum)"),
    ({"rms_norm": _eps_outside_the_root}, "rms_norm, T=1, H=64"),
    ({"rms_norm": _half_precision_sum}, "rms_norm, T="),
    ({"gelu_tanh_and_mul": _exact_gelu}, "gelu_tanh_and_mul, T=1, I=48"),
    ({"silu_and_mul": _swapped_halves}, "silu_and_mul, T=1, I=48"),
    ({"rotary_write_kv": _unrotated_keys}, "rotary_write_kv, T=1, Hq=4, Hkv=2, D=64 "
                                           "(the KV cache)"),
    ({"rotary_write_kv": _values_not_written}, "(the KV cache)"),
    ({"rotary_write_kv": _next_slot}, "rotary_write_kv, T=1, Hq=4, Hkv=2, D=64 (the KV"),
    ({"rotary_write_kv": _interleaved_pairs}, "rotary_write_kv, T=1, Hq=4, Hkv=2, D=64: "),
])
def test_broken_ops_fail_naming_the_op_and_case(ops, words):
    options = ConformanceOptions(checks=("layer-ops",), dtypes=(torch.float32,))
    [row] = run_conformance(_with_ops(**ops), options, expected_name="cpu").results
    assert row.outcome is Outcome.FAIL
    assert words in row.reason


def test_an_op_that_raises_or_returns_a_wrong_dtype_is_reported():
    def raises(x):
        raise RuntimeError("no kernel for this shape")

    options = ConformanceOptions(checks=("layer-ops",), dtypes=(torch.bfloat16,))
    [row] = run_conformance(_with_ops(silu_and_mul=raises), options,
                            expected_name="cpu").results
    assert row.outcome is Outcome.FAIL
    assert "silu_and_mul, T=1, I=48: raised RuntimeError: no kernel" in row.reason

    [row] = run_conformance(_with_ops(silu_and_mul=lambda x: reference.silu_and_mul(
        x.float())), options, expected_name="cpu").results
    assert row.outcome is Outcome.FAIL and "torch.float32, expected (1, 48)" in row.reason
