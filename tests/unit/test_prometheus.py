"""The Prometheus registry and its text format (0.0.4), and the server's metric set fed
with made-up outputs: everything is parsed back from the rendered text."""

from __future__ import annotations

import math
import re

import pytest
from prometheus_text import buckets, parse, value
from quire.engine import EngineStats
from quire.entrypoints.server.metrics import ServerMetrics, finish_reason, token_buckets
from quire.entrypoints.server.prometheus import CONTENT_TYPE, Registry
from quire.outputs import CompletionOutput, RequestMetrics, RequestOutput


# -- the registry -------------------------------------------------------------------------
def test_types_help_and_initial_values():
    r = Registry()
    r.counter("quire:things_total", "Things.\nSecond line with a \\ backslash.")
    r.gauge("quire:level", "A level.")
    r.histogram("quire:wait_seconds", "Waits.", [0.5, 1])
    r.counter("quire:labelled_total", "Per reason.", ["reason"])
    samples, types, helps = parse(r.render())
    assert types == {"quire:things_total": "counter", "quire:level": "gauge",
                     "quire:wait_seconds": "histogram", "quire:labelled_total": "counter"}
    assert helps["quire:things_total"] == "Things.\\nSecond line with a \\\\ backslash."
    assert value(samples, "quire:things_total") == 0
    assert value(samples, "quire:level") == 0
    assert value(samples, "quire:wait_seconds_count") == 0
    # a labelled metric has no sample until a label value is used
    assert not [k for k in samples if k[0] == "quire:labelled_total"]
    assert CONTENT_TYPE == "text/plain; version=0.0.4; charset=utf-8"


def test_histogram_buckets_are_cumulative_with_inf_sum_and_count():
    r = Registry()
    h = r.histogram("lat_seconds", "Latency.", [0.1, 1.0, 10.0])
    for v in (0.05, 0.1, 0.5, 1.0, 3.0, 100.0):  # a value equal to a bound is in it
        h.observe(v)
    samples, _, _ = parse(r.render())
    assert buckets(samples, "lat_seconds") == {0.1: 2, 1.0: 4, 10.0: 5, math.inf: 6}
    assert value(samples, "lat_seconds_count") == 6
    assert value(samples, "lat_seconds_sum") == pytest.approx(104.65)
    text = r.render()
    assert 'lat_seconds_bucket{le="+Inf"} 6.0' in text
    # the buckets are rendered in increasing order
    les = re.findall(r'le="([^"]+)"', text)
    assert les == ["0.1", "1.0", "10.0", "+Inf"]


def test_labelled_histogram_keeps_le_last():
    r = Registry()
    h = r.histogram("size", "Sizes.", [1, 2], ["kind"])
    h.labels(kind="a").observe(2)
    text = r.render()
    assert 'size_bucket{kind="a",le="1.0"} 0.0' in text
    assert 'size_count{kind="a"} 1.0' in text


def test_counters_only_go_up():
    r = Registry()
    c = r.counter("n_total", "N.")
    seen = []
    for amount in (1, 0, 2.5):
        c.inc(amount)
        seen.append(value(parse(r.render())[0], "n_total"))
    assert seen == sorted(seen) == [1, 1, 3.5]
    with pytest.raises(ValueError, match="only goes up"):
        c.inc(-1)
    c.sync(10)
    assert c.value == 10
    with pytest.raises(ValueError, match="only goes up"):
        c.sync(9)
    assert c.value == 10


def test_gauges_go_both_ways():
    r = Registry()
    g = r.gauge("g", "G.")
    g.set(5)
    g.inc(-2)
    assert value(parse(r.render())[0], "g") == 3


def test_label_values_are_escaped_and_round_trip():
    r = Registry()
    c = r.counter("req_total", "Requests.", ["reason", "who"])
    odd = 'say "hi"\\\nbye'
    c.labels(reason=odd, who="plain").inc()
    c.labels(reason="stop", who="x").inc(2)
    text = r.render()
    assert r'reason="say \"hi\"\\\nbye"' in text
    samples, _, _ = parse(text)
    assert value(samples, "req_total", reason=odd, who="plain") == 1
    assert value(samples, "req_total", reason="stop", who="x") == 2


def test_special_values_render_as_the_format_spells_them():
    r = Registry()
    r.gauge("up", "U.").set(math.inf)
    r.gauge("down", "D.").set(-math.inf)
    r.gauge("nan", "N.").set(math.nan)
    lines = r.render().splitlines()
    assert "up +Inf" in lines and "down -Inf" in lines and "nan NaN" in lines


@pytest.mark.parametrize("make,match", [
    (lambda r: r.counter("no_suffix", "x"), "_total"),
    (lambda r: r.gauge("1bad", "x"), "not a valid metric name"),
    (lambda r: r.gauge("g", "x", ["bad-label"]), "invalid label names"),
    (lambda r: r.gauge("g", "x", ["__reserved"]), "invalid label names"),
    (lambda r: r.histogram("h", "x", [1, 1]), "strictly increasing"),
    (lambda r: r.histogram("h", "x", [2, 1]), "strictly increasing"),
    (lambda r: r.histogram("h", "x", [1, math.inf]), "finite"),
    (lambda r: r.histogram("h", "x", []), "finite"),
    (lambda r: r.histogram("h", "x", [1], ["le"]), "'le'"),
])
def test_bad_definitions_are_refused_by_name(make, match):
    with pytest.raises(ValueError, match=match):
        make(Registry())


def test_repeated_names_and_wrong_labels_are_refused():
    r = Registry()
    c = r.counter("a_total", "A.", ["reason"])
    with pytest.raises(ValueError, match="already exists"):
        r.gauge("a_total", "again")
    with pytest.raises(ValueError, match="use .labels"):
        c.inc()
    with pytest.raises(ValueError, match="has labels"):
        c.labels(other="x")


# -- the server's metric set --------------------------------------------------------------
def output(rid: str, n_tokens: int, *, arrival: float = 100.0, scheduled: float | None = 100.5,
           first: float | None = 101.0, last: float | None = None,
           finished: float | None = None, reason: str | None = None,
           prompt_len: int = 7) -> RequestOutput:
    last = first if last is None else last
    done = reason is not None
    return RequestOutput(
        request_id=rid, prompt=None, prompt_token_ids=list(range(prompt_len)),
        outputs=[CompletionOutput(0, "", list(range(n_tokens)), finish_reason=reason)],
        finished=done,
        metrics=RequestMetrics(arrival, scheduled, first, last if n_tokens else None,
                               finished if done else None))


def stats(**kw) -> EngineStats:
    base = {"num_running": 0, "num_waiting": 0, "kv_usage": 0.0, "num_used_blocks": 0,
            "num_blocks": 64, "num_preemptions": 0, "prefix_queries": 0, "prefix_hits": 0,
            "has_unfinished": False}
    return EngineStats(**{**base, **kw})


def test_server_metrics_follow_a_request_token_by_token():
    m = ServerMetrics(max_model_len=128)
    # the server's outputs are deltas: one new token each
    m.observe(output("a", 1, first=101.0))
    m.observe(output("a", 1, first=101.0, last=101.25))
    m.observe(output("a", 1, first=101.0, last=101.75, finished=101.75, reason="length"))
    samples, types, _ = parse(m.render(stats()))
    assert value(samples, "quire:prompt_tokens_total") == 7
    assert value(samples, "quire:generation_tokens_total") == 3
    assert value(samples, "quire:time_to_first_token_seconds_count") == 1
    assert value(samples, "quire:time_to_first_token_seconds_sum") == pytest.approx(1.0)
    assert value(samples, "quire:inter_token_latency_seconds_count") == 2
    assert value(samples, "quire:inter_token_latency_seconds_sum") == pytest.approx(0.75)
    assert value(samples, "quire:e2e_request_latency_seconds_sum") == pytest.approx(1.75)
    assert value(samples, "quire:request_queue_time_seconds_sum") == pytest.approx(0.5)
    assert value(samples, "quire:request_generation_tokens_sum") == 3
    assert value(samples, "quire:request_prompt_tokens_count") == 1
    assert value(samples, "quire:request_success_total", finished_reason="length") == 1
    assert value(samples, "quire:request_success_total", finished_reason="stop") == 0
    assert value(samples, "quire:request_success_total", finished_reason="abort") == 0
    assert types["quire:request_success_total"] == "counter"
    assert not m._seen  # nothing kept for a finished request


def test_server_metrics_count_aborts_before_and_after_the_first_token():
    m = ServerMetrics(max_model_len=128)
    # aborted while waiting: never scheduled, no token, prompt never computed
    m.observe(output("w", 0, scheduled=None, first=None, finished=100.2, reason="abort"))
    # aborted mid-run: the abort output adds no token and repeats the last token time,
    # adding no latency
    m.observe(output("r", 1, first=101.0))
    m.observe(output("r", 0, first=101.0, last=101.0, finished=102.0, reason="abort"))
    samples, _, _ = parse(m.render(stats()))
    assert value(samples, "quire:request_success_total", finished_reason="abort") == 2
    assert value(samples, "quire:e2e_request_latency_seconds_count") == 2
    assert value(samples, "quire:request_queue_time_seconds_count") == 1
    assert value(samples, "quire:time_to_first_token_seconds_count") == 1
    assert value(samples, "quire:inter_token_latency_seconds_count") == 0
    assert value(samples, "quire:prompt_tokens_total") == 7
    assert value(samples, "quire:generation_tokens_total") == 1


def test_server_metrics_engine_figures_come_from_the_stats_snapshot():
    m = ServerMetrics(max_model_len=128)
    samples, _, _ = parse(m.render(stats()))
    assert value(samples, "quire:prefix_cache_hit_rate") == 0  # no division by zero
    samples, _, _ = parse(m.render(stats(num_running=2, num_waiting=3, kv_usage=0.25,
                                         num_used_blocks=16, num_preemptions=4,
                                         prefix_queries=40, prefix_hits=10)))
    assert value(samples, "quire:num_requests_running") == 2
    assert value(samples, "quire:num_requests_waiting") == 3
    assert value(samples, "quire:kv_cache_usage_perc") == 0.25
    assert value(samples, "quire:num_kv_blocks_used") == 16
    assert value(samples, "quire:num_kv_blocks_total") == 64
    assert value(samples, "quire:num_preemptions_total") == 4
    assert value(samples, "quire:prefix_cache_queries_total") == 40
    assert value(samples, "quire:prefix_cache_hits_total") == 10
    assert value(samples, "quire:prefix_cache_hit_rate") == 0.25


def test_finish_reason_of_several_samples():
    def out(*reasons):
        return RequestOutput("r", None, [1], [CompletionOutput(i, "", [], finish_reason=x)
                                              for i, x in enumerate(reasons)], finished=True)

    assert finish_reason(out("stop", "stop")) == "stop"
    assert finish_reason(out("stop", "length")) == "length"
    assert finish_reason(out("length", "abort")) == "abort"


def test_token_buckets_run_1_2_5_up_to_the_context():
    assert token_buckets(128) == [1, 2, 5, 10, 20, 50, 100]
    assert token_buckets(1) == [1]
    assert token_buckets(1000)[-1] == 1000
