"""The conformance suite's quantized-linear check: the cpu platform passes every method
it declares, and broken ops fail with a reason naming the format and the case."""

from __future__ import annotations

import pytest
import torch
from quire.conformance import ConformanceOptions, Outcome, run_conformance
from quire.ops import quantized, reference_ops
from quire.platforms.cpu.platform import CpuPlatform

ONLY = ConformanceOptions(checks=("quant-linear",), dtypes=(torch.float32,))


def _with_ops(**ops):
    class Patched(CpuPlatform):
        def make_ops(self):
            return reference_ops().with_ops("broken", **ops)

    return Patched()


def test_cpu_platform_passes_every_declared_method():
    platform = CpuPlatform()
    rows = run_conformance(platform, ONLY).results
    assert [r.case for r in rows] == [f"{m}, float32" for m in platform.quantizations
                                      if m != "none"]
    for row in rows:
        assert row.outcome is Outcome.PASS, row.reason


def _no_bias(x, weight, bias=None, **kwargs):
    return quantized.quantized_linear(x, weight, None, **kwargs)


def _bfloat16_products(x, weight, bias=None, **kwargs):
    # a kernel that silently multiplies in bfloat16
    y = quantized.quantized_linear(x.bfloat16().float(), weight, bias, **kwargs)
    return (y.bfloat16().float() + (y - y)).to(x.dtype)


def _drops_the_last_block(x, weight, bias=None, **kwargs):
    if weight.format.block < 32:
        return quantized.quantized_linear(x, weight, bias, **kwargs)
    block = weight.format.block
    kept = weight.narrow_cols(0, weight.cols - block)
    return quantized.quantized_linear(x[..., :kept.cols], kept, bias, **kwargs)


@pytest.mark.parametrize("op, words", [
    (_no_bias, "f32, M=1, N=48, K=256"),
    (_bfloat16_products, "x the bound"),
    (_drops_the_last_block, "q4_0, M=1"),
])
def test_broken_ops_fail_naming_the_format_and_case(op, words):
    rows = run_conformance(_with_ops(quantized_linear=op), ONLY,
                           expected_name="cpu").results
    gguf = next(r for r in rows if r.case == "gguf, float32")
    assert gguf.outcome is Outcome.FAIL
    assert words in gguf.reason


def test_a_platform_declaring_no_method_is_not_run():
    class NoQuant(CpuPlatform):
        quantizations = ("none",)

    [row] = run_conformance(NoQuant(), ONLY, expected_name="cpu").results
    assert row.outcome is Outcome.NOT_RUN
    assert "Platform.quantizations" in row.reason
