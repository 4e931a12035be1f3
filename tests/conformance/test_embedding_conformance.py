"""The conformance suite's embedding check: the cpu platform passes, and broken ops fail
with a reason that names the op and the case."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from quire.conformance import ConformanceOptions, Outcome, run_conformance
from quire.ops import pooling, reference_ops
from quire.platforms.cpu.platform import CpuPlatform

ONLY_EMBEDDING = ConformanceOptions(checks=("embedding",))


def _with_ops(**ops):
    class Patched(CpuPlatform):
        def make_ops(self):
            return reference_ops().with_ops("broken", **ops)

    return Patched()


def test_cpu_platform_passes_every_declared_dtype():
    platform = CpuPlatform()
    rows = run_conformance(platform, ONLY_EMBEDDING).results
    assert [r.case for r in rows] == [str(d).removeprefix("torch.")
                                      for d in platform.supported_dtypes]
    for row in rows:
        assert row.outcome is Outcome.PASS, row.reason
        assert "pool: reference" in row.figure


def _causal(query, key, value, query_start_loc, query_lens, *, scale):
    out = [F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                          v.transpose(0, 1), is_causal=True,
                                          scale=scale).transpose(0, 1)
           for q, k, v in zip(query.split(list(query_lens)), key.split(list(query_lens)),
                              value.split(list(query_lens)))]
    return torch.cat(out)


def _whole_batch(query, key, value, query_start_loc, query_lens, *, scale):
    return pooling.bidirectional_attention(query, key, value, query_start_loc,
                                           [sum(query_lens)], scale=scale)


def _never_normalized(hidden, query_start_loc, method, normalize):
    return pooling.pool(hidden, query_start_loc, method, False)


def _low_precision_mean(hidden, query_start_loc, method, normalize):
    return pooling.pool(hidden.bfloat16().float(), query_start_loc, method, normalize)


@pytest.mark.parametrize("ops, words", [
    ({"bidirectional_attention": _causal}, "bidirectional_attention, lengths=[5, 1, 9, 3]"),
    ({"bidirectional_attention": _whole_batch}, "bidirectional_attention, lengths=[5, 1"),
    ({"pool": _never_normalized}, "pool mean normalized, lengths=[1]"),
    ({"pool": _low_precision_mean}, "pool mean, lengths="),
])
def test_broken_ops_fail_naming_the_op_and_case(ops, words):
    options = ConformanceOptions(checks=("embedding",), dtypes=(torch.float32,))
    [row] = run_conformance(_with_ops(**ops), options, expected_name="cpu").results
    assert row.outcome is Outcome.FAIL
    assert words in row.reason
