"""``quire bench serve --concurrency 1,2,4 --slo-ttft S``: each level judged against the
SLO at p95, levels stepped up to the first miss, and the capacity reported. Judged on
synthetic results, with the p95 computed here by the standard library."""

from __future__ import annotations

import statistics

import pytest
from quire.bench.serve import RequestResult, ServeRun
from quire.bench.slo import capacity, judge, parse_levels, report, step_levels
from quire.bench.stats import SLO


def p95(values: list[float]) -> float:
    """The oracle: linear interpolation between closest ranks (numpy's default)."""
    return statistics.quantiles(values, n=100, method="inclusive")[94]


def synthetic_run(concurrency: int, failed: int = 0) -> ServeRun:
    """Latencies that grow with concurrency: TTFT 0.1 s per client, spread by request."""
    results = [RequestResult(ok=True, status=200, ttft_s=0.1 * concurrency * (1 + i / 20),
                             e2e_s=1.0 * concurrency * (1 + i / 40), chunks=4)
               for i in range(20)]
    results += [RequestResult(ok=False, status=503)] * failed
    return ServeRun(results, duration_s=10.0)


@pytest.mark.parametrize("concurrency", [1, 4, 6, 7, 12])
def test_a_level_meets_when_its_p95_is_within_every_target(concurrency):
    slo = SLO(ttft_s=0.8, e2e_s=8.0)
    run = synthetic_run(concurrency)
    ok = [r for r in run.results if r.ok]
    ttft, e2e = p95([r.ttft_s for r in ok]), p95([r.e2e_s for r in ok])
    level = judge(concurrency, run.figures(slo), slo)
    assert level.met == (ttft <= 0.8 and e2e <= 8.0), (ttft, e2e)
    assert level.figures["ttft_s_p95"] == pytest.approx(ttft)
    assert any("TTFT" in m for m in level.misses) == (ttft > 0.8)
    assert any("E2E" in m for m in level.misses) == (e2e > 8.0)


def test_failed_requests_miss_whatever_the_latencies():
    slo = SLO(ttft_s=100.0)
    assert judge(1, synthetic_run(1).figures(slo), slo).met
    level = judge(1, synthetic_run(1, failed=1).figures(slo), slo)
    assert not level.met and "1 requests failed" in level.misses
    assert not judge(1, ServeRun([RequestResult(ok=False)], 1.0).figures(slo), slo).met
    with pytest.raises(ValueError, match="objective"):
        judge(1, {}, SLO())


def test_levels_step_up_to_the_first_miss_and_capacity_is_the_last_met():
    slo = SLO(ttft_s=0.8)
    measured = []

    def measure(concurrency: int) -> dict[str, float]:
        measured.append(concurrency)
        return synthetic_run(concurrency).figures(slo)

    levels = step_levels([1, 2, 4, 8, 16], measure, slo)
    # the oracle: the last level whose own p95 TTFT is within 0.8 s
    ok = [c for c in (1, 2, 4, 8, 16)
          if p95([r.ttft_s for r in synthetic_run(c).results]) <= 0.8]
    assert measured == [1, 2, 4, 8]  # stopped at the first miss
    assert [lv.met for lv in levels] == [True, True, True, False]
    assert capacity(levels) == max(ok) == 4
    text = report(levels, slo)
    assert "capacity: 4 concurrent at p95 TTFT <= 0.8s" in text
    assert "no: TTFT p95" in text


def test_capacity_is_none_when_the_first_level_misses_and_ignores_levels_after_a_miss():
    slo = SLO(e2e_s=0.5)
    levels = [judge(c, synthetic_run(c).figures(slo), slo) for c in (1, 2)]
    assert capacity(levels) is None
    assert "no level tried meets p95 E2E <= 0.5s" in report(levels, slo)
    met, missed = (judge(c, synthetic_run(c).figures(SLO(ttft_s=0.25)), SLO(ttft_s=0.25))
                   for c in (1, 2))
    assert met.met and not missed.met
    assert capacity([met, missed, met]) == 1


@pytest.mark.parametrize("text, words", [("0,1", "'0'"), ("1,x", "'x'"), ("4,2", "increase"),
                                         ("2,2", "increase"), ("", "''")])
def test_bad_levels_are_named(text, words):
    with pytest.raises(ValueError, match=words):
        parse_levels(text)


def test_levels_parse():
    assert parse_levels("8") == [8]
    assert parse_levels("1, 2,4,8") == [1, 2, 4, 8]
