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
    # its op takes bf16_activations: one more row for each weight-only method
    assert [r.case for r in rows] == [f"{m}, float32" for m in platform.quantizations
                                      if m != "none"] + [
        f"{m}, float32, bf16_activations" for m in platform.quantizations
        if m not in ("none", "w8a8")]
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


def test_bf16_activations_rows_hold_an_op_that_takes_the_keyword():
    """Only an op that takes ``bf16_activations`` gets its rows; there a product that
    drops a block fails them, and a rounded one passes."""
    def rounded(x, weight, bias=None, *, int8_activations=False, bf16_activations=False):
        return quantized.quantized_linear(x, weight, bias, int8_activations=int8_activations,
                                          bf16_activations=bf16_activations)

    def dropping(x, weight, bias=None, *, int8_activations=False, bf16_activations=False):
        return _drops_the_last_block(x, weight, bias, int8_activations=int8_activations)

    for op, passes in ((rounded, True), (dropping, False)):
        rows = run_conformance(_with_ops(quantized_linear=op), ONLY,
                               expected_name="cpu").results
        row = next(r for r in rows if r.case == "gguf, float32, bf16_activations")
        assert (row.outcome is Outcome.PASS) == passes, row.reason
    rows = run_conformance(_with_ops(quantized_linear=_no_bias), ONLY,
                           expected_name="cpu").results
    assert not any("bf16_activations" in r.case for r in rows)


def test_a_platform_declaring_no_method_is_not_run():
    class NoQuant(CpuPlatform):
        quantizations = ("none",)

    [row] = run_conformance(NoQuant(), ONLY, expected_name="cpu").results
    assert row.outcome is Outcome.NOT_RUN
    assert "Platform.quantizations" in row.reason
