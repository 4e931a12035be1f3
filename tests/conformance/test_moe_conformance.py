"""The conformance suite's MoE check: the cpu platform passes, and broken ops fail with a
reason that names the op and the case. (The Triton kernels' row, in the interpreter, is
in ``tests/kernels/test_triton_moe.py``.)"""

from __future__ import annotations

import pytest
import torch
from quire.conformance import ConformanceOptions, Outcome, run_conformance
from quire.ops import moe, reference_ops
from quire.platforms.cpu.platform import CpuPlatform

ONLY_MOE = ConformanceOptions(checks=("moe",))


def _with_ops(**ops):
    class Patched(CpuPlatform):
        def make_ops(self):
            return reference_ops().with_ops("broken", **ops)

    return Patched()


def test_cpu_platform_passes_every_declared_dtype():
    platform = CpuPlatform()
    rows = run_conformance(platform, ONLY_MOE).results
    assert [r.case for r in rows] == [str(d).removeprefix("torch.")
                                      for d in platform.supported_dtypes]
    for row in rows:
        assert row.outcome is Outcome.PASS, row.reason
        assert "fused_moe: reference" in row.figure


def _unweighted(hidden, w13, w2, weights, ids):
    return moe.fused_moe(hidden, w13, w2, torch.ones_like(weights), ids)


def _low_precision(hidden, w13, w2, weights, ids):
    # what a kernel that silently multiplies float32 in a 10-bit mantissa (TF32) gets
    low = (hidden.bfloat16().float(), w13.bfloat16().float(), w2.bfloat16().float())
    return moe.fused_moe(*low, weights, ids)


def _never_renormalized(router_logits, top_k, renormalize):
    return moe.select_experts(router_logits, top_k, False)


def _lowest_experts(router_logits, top_k, renormalize):
    return moe.select_experts(-router_logits, top_k, renormalize)


@pytest.mark.parametrize("ops, words", [
    ({"fused_moe": _unweighted}, "fused_moe, T=1, H=64"),
    ({"fused_moe": _low_precision}, "fused_moe, T="),
    ({"select_experts": _never_renormalized}, "select_experts, T=1, H=64, I=48, E=8, "
                                              "top_k=2: weights off by"),
    ({"select_experts": _lowest_experts}, "chose other experts than the reference"),
])
def test_broken_ops_fail_naming_the_op_and_case(ops, words):
    options = ConformanceOptions(checks=("moe",), dtypes=(torch.float32,))
    [row] = run_conformance(_with_ops(**ops), options, expected_name="cpu").results
    assert row.outcome is Outcome.FAIL
    assert words in row.reason
