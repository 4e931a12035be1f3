"""The conformance suite's quantised-KV check: the cpu platform passes for every KV dtype
it declares and every dtype, a backend that declares none is "not run" with the reason,
and a backend that misreads its scales fails."""

from __future__ import annotations

import torch
from quire.conformance import ConformanceOptions, Outcome, run_conformance
from quire.ops.attention import ReferenceAttentionBackend
from quire.platforms.cpu.platform import CpuPlatform

ONLY = ConformanceOptions(checks=("kv-quant",), dtypes=(torch.float32,))


def test_cpu_platform_passes_int8_and_fp8_pages():
    rows = run_conformance(CpuPlatform(), ONLY).results
    assert [r.case for r in rows] == ["int8 pages, float32", "fp8 pages, float32"]
    for row in rows:
        assert row.outcome is Outcome.PASS, row.reason


class _Declares(CpuPlatform):
    def __init__(self, backend):
        super().__init__()
        self._backend = backend

    def make_attention_backend(self):
        return self._backend


class _NoQuantised(ReferenceAttentionBackend):
    name = "old"
    kv_cache_dtypes = ()


class _ScaleIgnored(ReferenceAttentionBackend):
    """Reads the quantised values without their scale."""

    kv_cache_dtypes = ("int8",)

    def attend(self, query, kv_cache, metadata, **kwargs):
        unscaled = kv_cache.clone()
        unscaled[..., -4:].view(torch.float32).fill_(1.0)  # every scale 1
        return super().attend(query, unscaled, metadata, **kwargs)


def test_an_undeclared_kv_dtype_is_not_run_with_the_reason():
    rows = run_conformance(_Declares(_NoQuantised()), ONLY).results
    assert [r.outcome for r in rows] == [Outcome.NOT_RUN, Outcome.NOT_RUN]
    assert "declares no int8 pages" in rows[0].reason


def test_a_backend_that_ignores_the_scales_fails():
    rows = run_conformance(_Declares(_ScaleIgnored()), ONLY).results
    assert rows[0].outcome is Outcome.FAIL and "attention off by" in rows[0].reason
    assert rows[1].outcome is Outcome.NOT_RUN


class _PlainInt8(ReferenceAttentionBackend):
    """Declares int8 pages of the layout before plugin API 1.6 (the plain basis)."""

    kv_cache_dtypes = ("int8", "fp8")
    kv_int8_hadamard = False


def test_int8_pages_of_the_old_layout_are_not_run_and_fp8_still_is():
    rows = run_conformance(_Declares(_PlainInt8()), ONLY).results
    assert rows[0].outcome is Outcome.NOT_RUN and "before plugin API 1.6" in rows[0].reason
    assert rows[1].outcome is Outcome.PASS, rows[1].reason
