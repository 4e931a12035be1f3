"""Statistics, token timing and report formatting, on data whose answers are known."""

from __future__ import annotations

import math

import pytest
from quire.bench.latency import LatencyRun, RequestTiming
from quire.bench.peers.clock import TokenClock
from quire.bench.report import Column, Figure, comparison_table, format_value, grid
from quire.bench.serve import RequestResult, ServeRun, sse_events
from quire.bench.stats import (
    SLO,
    distribution,
    goodput,
    median,
    median_figures,
    percentile,
)
from quire.bench.throughput import ThroughputRun

TEN = [float(v) for v in range(10, 0, -1)]  # 10..1, unsorted on purpose


@pytest.mark.parametrize("q, expected", [(0, 1.0), (50, 5.5), (95, 9.55), (99, 9.91),
                                         (100, 10.0), (25, 3.25)])
def test_percentiles_interpolate_between_ranks(q, expected):
    assert percentile(TEN, q) == pytest.approx(expected)


def test_percentile_edges():
    assert percentile([4.0], 95) == 4.0
    assert math.isnan(percentile([], 50))
    assert median([3.0, 1.0, 2.0]) == 2.0
    with pytest.raises(ValueError, match="q must be in"):
        percentile(TEN, 101)


def test_distribution_names_its_figures():
    figures = distribution("ttft_s", [1.0, 2.0, 3.0, 4.0], (50, 95))
    assert figures == {"ttft_s_p50": 2.5, "ttft_s_p95": pytest.approx(3.85),
                       "ttft_s_mean": 2.5}


def test_median_over_repeats_per_figure():
    runs = [{"a": 1.0, "b": 10.0}, {"a": 3.0, "b": math.nan}, {"a": 2.0}]
    assert median_figures(runs) == {"a": 2.0, "b": 10.0}


def test_goodput_counts_requests_meeting_every_slo():
    samples = [(0.1, 1.0), (0.5, 1.0), (0.1, 3.0), (0.2, 2.0)]
    assert goodput(samples, 2.0, SLO(ttft_s=0.2)) == 1.5  # 3 of 4 within TTFT, per 2 s
    assert goodput(samples, 2.0, SLO(e2e_s=2.0)) == 1.5
    assert goodput(samples, 2.0, SLO(ttft_s=0.2, e2e_s=2.0)) == 1.0  # both: 2 of 4
    assert goodput(samples, 2.0, SLO()) == 2.0  # no objective: every request counts
    with pytest.raises(ValueError, match="ttft_s"):
        SLO(ttft_s=0)


def test_serve_figures_count_overload_apart_and_goodput():
    ok = [RequestResult(ok=True, status=200, ttft_s=t, e2e_s=e, itl_s=[0.1] * 3, chunks=4,
                        completion_tokens=4) for t, e in [(0.1, 0.5), (0.3, 0.9)]]
    shed = RequestResult(ok=False, status=503)
    broken = RequestResult(ok=False, error="ConnectError")
    figures = ServeRun(ok + [shed, broken], duration_s=2.0).figures(SLO(ttft_s=0.2))
    assert figures["completed"] == 2 and figures["overloaded_503"] == 1
    assert figures["errors"] == 1
    assert figures["requests_per_s"] == 1.0
    assert figures["goodput_requests_per_s"] == 0.5
    assert figures["output_tokens_per_s"] == 4.0
    assert figures["ttft_s_p50"] == pytest.approx(0.2)


def test_sse_events_stop_at_done():
    lines = ['data: {"choices": [{"text": "a"}]}', "", ": keep-alive",
             'data: {"usage": {"completion_tokens": 1}}', "data: [DONE]", 'data: {"x": 1}']
    assert list(sse_events(lines)) == [{"choices": [{"text": "a"}]},
                                       {"usage": {"completion_tokens": 1}}]


def test_token_clock_splits_a_burst_evenly():
    clock = TokenClock(start=10.0)
    clock.observe(1, now=10.5)  # TTFT 0.5
    clock.observe(1, now=10.6)  # nothing new
    clock.observe(2, now=10.7)
    clock.observe(5, now=11.0)  # three tokens at once: three gaps of 0.1
    timing = clock.timing()
    assert timing["ttft_s"] == pytest.approx(0.5)
    assert timing["e2e_s"] == pytest.approx(1.0)
    assert timing["itl_s"] == pytest.approx([0.2, 0.1, 0.1, 0.1])
    assert timing["output_tokens"] == 5


def test_run_figures():
    run = ThroughputRun(elapsed_s=2.0, num_requests=4, prompt_tokens=40, output_tokens=20,
                        peak_rss_bytes=3 << 20)
    assert run.figures() == {"requests_per_s": 2.0, "output_tokens_per_s": 10.0,
                             "total_tokens_per_s": 30.0, "elapsed_s": 2.0, "peak_rss_mib": 3.0}
    lat = LatencyRun([RequestTiming(0.2, 1.2, 3, [0.5, 0.5])]).figures()
    assert lat["ttft_s_p50"] == 0.2 and lat["itl_s_p95"] == 0.5
    assert lat["decode_tokens_per_s"] == 2.0


def test_comparison_table_puts_ratios_on_every_figure():
    figures = [Figure("tps", "tokens/s"), Figure("ttft", "TTFT (ms)", 1000.0),
               Figure("absent", "never shown")]
    columns = [Column("quire", "", [{"tps": 30.0, "ttft": 0.1}]),
               Column("hf", "", [{"tps": 10.0, "ttft": 0.4}])]
    lines = comparison_table(figures, columns).splitlines()
    assert lines[0].split() == ["figure", "quire", "hf", "quire/hf"]
    assert lines[2].split() == ["tokens/s", "30", "10", "3.00x"]
    assert lines[3].split() == ["TTFT", "(ms)", "100", "400", "0.25x"]
    assert len(lines) == 4
    assert format_value(math.nan) == "-" and format_value(0.123456) == "0.1235"
    assert grid(["a", "b"], [["x", "1"]]).splitlines()[2] == "x  1"


def test_requests_alternate_over_targets_or_shift_from_one_to_the_other():
    from quire.bench.serve import target_of

    assert [target_of(i, 6, 2) for i in range(6)] == [0, 1, 0, 1, 0, 1]
    assert [target_of(i, 6, 2, "halves") for i in range(6)] == [0, 0, 0, 1, 1, 1]
    assert [target_of(i, 5, 1, "halves") for i in range(5)] == [0] * 5


def test_serve_targets_pair_names_with_one_url_or_a_url_each():
    from quire.entrypoints.cli.bench import serve_targets
    from quire.entrypoints.cli.common import UsageError

    assert serve_targets(["u"], None) == [("u", None)]
    assert serve_targets(["u"], ["a", "b"]) == [("u", "a"), ("u", "b")]
    assert serve_targets(["u", "v"], ["a", "b"]) == [("u", "a"), ("v", "b")]
    assert serve_targets(["u", "v"], None) == [("u", None), ("v", None)]
    with pytest.raises(UsageError, match="one per --url"):
        serve_targets(["u", "v"], ["a"])
