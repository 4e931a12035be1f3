"""The conformance suite's LoRA check: the cpu platform passes in every declared dtype,
and broken ops fail with a reason that names the case. (The Triton kernels' rows, in the
interpreter, are in ``tests/kernels/test_triton_lora.py``.)"""

from __future__ import annotations

import pytest
import torch
from quire.conformance import ConformanceOptions, Outcome, run_conformance
from quire.ops import lora, reference_ops
from quire.platforms.cpu.platform import CpuPlatform

ONLY = ConformanceOptions(checks=("lora",), dtypes=(torch.float32,))


def _with_ops(**ops):
    class Patched(CpuPlatform):
        def make_ops(self):
            return reference_ops().with_ops("broken", **ops)

    return Patched()


def test_cpu_platform_passes_every_declared_dtype():
    platform = CpuPlatform()
    rows = run_conformance(platform, ConformanceOptions(checks=("lora",))).results
    assert [r.case for r in rows] == [str(d).removeprefix("torch.")
                                      for d in platform.supported_dtypes]
    for row in rows:
        assert row.outcome is Outcome.PASS, row.reason
        assert "lora_linear: reference" in row.figure


def _rank_cut_to_8(y, x, a, b, offsets, token_slots):
    return lora.lora_linear(y, x, a[:, :, :8], b[:, :, :8], offsets, token_slots)


def _first_slice_everywhere(y, x, a, b, offsets, token_slots):
    return lora.lora_linear(y, x, a[:, :1], b, (0,), token_slots)


def _base_tokens_get_slot_0(y, x, a, b, offsets, token_slots):
    return lora.lora_linear(y, x, a, b, offsets, token_slots.clamp(min=0))


def _bfloat16_products(y, x, a, b, offsets, token_slots):
    # what a kernel that silently multiplies float32 in a short mantissa gets
    low = [t.bfloat16().to(t.dtype) for t in (x, a, b)]
    return lora.lora_linear(y, *low, offsets, token_slots)


def _wrong_dtype(y, x, a, b, offsets, token_slots):
    return lora.lora_linear(y.double(), x, a, b, offsets, token_slots)


@pytest.mark.parametrize("op, words", [
    (_rank_cut_to_8, "ranks=(1, 8, 16), R=16: max |err|"),
    (_first_slice_everywhere, "offsets=(0, 64, 80)"),
    (_base_tokens_get_slot_0, "changed the row of a token with slot -1"),
    (_bfloat16_products, "max |err|"),
    (_wrong_dtype, "torch.float64, expected (1, 50) torch.float32"),
])
def test_broken_ops_fail_naming_the_case(op, words):
    [row] = run_conformance(_with_ops(lora_linear=op), ONLY, expected_name="cpu").results
    assert row.outcome is Outcome.FAIL
    assert words in row.reason
