"""SLO tracking in the server's metrics: TTFT and queue time by prompt-length band, and
the counter of requests that missed ``--slo-ttft``/``--slo-e2e``. ``ServerMetrics`` is fed
synthetic outputs with known timings and its text is read back with the tests' own
Prometheus reader."""

from __future__ import annotations

import pytest
from prometheus_text import parse
from quire.entrypoints.server.metrics import ServerMetrics
from quire.entrypoints.server.slo import SLOTargets, band_of, prompt_len_bands
from quire.outputs import CompletionOutput, RequestOutput, request_metrics

MAX_LEN = 200
TTFT = "quire:time_to_first_token_by_prompt_len_seconds"
QUEUE = "quire:request_queue_time_by_prompt_len_seconds"
MISSED = "quire:request_slo_missed_total"


def expected_band(prompt_len: int, max_len: int) -> str:
    """The oracle: the first of 16, 32, 64, ... at or above the length, capped at the
    context length."""
    bound = 16
    while bound < prompt_len and bound < max_len:
        bound *= 2
    return str(min(bound, max_len))


def finished(rid: str, prompt_len: int, queue: float, ttft: float | None,
             e2e: float) -> RequestOutput:
    """One request's only output, finished: a token at ``ttft`` (None: aborted first)."""
    metrics = request_metrics(100.0, 100.0 + queue,
                              None if ttft is None else 100.0 + ttft,
                              None if ttft is None else 100.0 + ttft, 100.0 + e2e)
    tokens = [] if ttft is None else [1]
    return RequestOutput(rid, None, list(range(prompt_len)),
                         [CompletionOutput(0, "", tokens,
                                           finish_reason="length" if tokens else "abort")],
                         finished=True, metrics=metrics)


def samples(metrics: ServerMetrics) -> dict:
    return parse(metrics.render([], {}))[0]


def count(s: dict, name: str, **labels: str) -> float:
    return s.get((name, tuple(sorted(labels.items()))), 0.0)


def test_bands_are_powers_of_two_up_to_the_context():
    assert prompt_len_bands(200) == [16, 32, 64, 128, 200]
    assert prompt_len_bands(128) == [16, 32, 64, 128]
    assert prompt_len_bands(8) == [8]
    for n in (1, 15, 16, 17, 100, 128, 129, 200):
        assert band_of(n, prompt_len_bands(MAX_LEN)) == expected_band(n, MAX_LEN), n
    with pytest.raises(ValueError, match="max_model_len"):
        prompt_len_bands(0)


def test_requests_land_in_their_prompt_length_band():
    metrics = ServerMetrics(MAX_LEN)
    lengths = [3, 16, 17, 40, 64, 65, 130, 199]
    for i, n in enumerate(lengths):
        metrics.observe(finished(f"r{i}", n, queue=0.01 * (i + 1), ttft=0.5, e2e=1.0))
    s = samples(metrics)
    for band in prompt_len_bands(MAX_LEN):
        want = sum(1 for n in lengths if expected_band(n, MAX_LEN) == str(band))
        for name in (TTFT, QUEUE):
            assert count(s, f"{name}_count", prompt_len_le=str(band)) == want, (name, band)
    # the queue times summed per band are those of its requests
    want = sum(0.01 * (i + 1) for i, n in enumerate(lengths) if expected_band(n, MAX_LEN) == "32")
    assert count(s, f"{QUEUE}_sum", prompt_len_le="32") == pytest.approx(want)
    # every request is in exactly one band, as in the unbanded histograms
    total = sum(v for (n, lbl), v in s.items() if n == f"{TTFT}_count")
    assert total == len(lengths) == count(s, "quire:time_to_first_token_seconds_count")


def test_a_request_over_an_objective_is_counted_one_under_is_not():
    metrics = ServerMetrics(MAX_LEN, SLOTargets(ttft_s=1.0, e2e_s=5.0))
    s = samples(metrics)
    assert count(s, MISSED, slo="ttft") == 0 and count(s, MISSED, slo="e2e") == 0
    assert (MISSED, (("slo", "ttft"),)) in s  # shown from the start
    metrics.observe(finished("fast", 10, queue=0.1, ttft=0.5, e2e=2.0))
    s = samples(metrics)
    assert count(s, MISSED, slo="ttft") == 0 and count(s, MISSED, slo="e2e") == 0
    metrics.observe(finished("slow-first", 10, queue=0.1, ttft=1.5, e2e=2.0))
    metrics.observe(finished("slow-end", 10, queue=0.1, ttft=0.5, e2e=6.0))
    metrics.observe(finished("slow-both", 10, queue=0.1, ttft=1.2, e2e=7.0))
    # aborted in the queue after longer than the TTFT objective: it missed it
    metrics.observe(finished("gave-up", 10, queue=1.9, ttft=None, e2e=2.0))
    s = samples(metrics)
    assert count(s, MISSED, slo="ttft") == 3
    assert count(s, MISSED, slo="e2e") == 2


def test_no_objective_no_series_and_a_bad_target_names_its_field():
    metrics = ServerMetrics(MAX_LEN)
    metrics.observe(finished("a", 10, queue=0.1, ttft=100.0, e2e=500.0))
    assert not [k for k in samples(metrics) if k[0] == MISSED]
    for bad in (0, -1.0, float("inf"), float("nan"), True):
        with pytest.raises(ValueError, match="ttft_s"):
            SLOTargets(ttft_s=bad)
        with pytest.raises(ValueError, match="e2e_s"):
            SLOTargets(e2e_s=bad)


def test_the_core_reports_kv_pages_by_prompt_band(tiny_checkpoint):
    from quire import LLM, SamplingParams

    llm = LLM(str(tiny_checkpoint("llama")), device="cpu", dtype="float32", block_size=16,
              max_model_len=128, enable_prefix_caching=False)
    engine = llm.engine
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)
    engine.add_request(list(range(3, 13)), params)  # 10 tokens: band 16, one page
    engine.add_request(list(range(3, 43)), params)  # 40 tokens: band 64, three pages
    engine.step()  # both prompts computed, their pages held
    stats = engine.core.stats()
    assert stats.prompt_len_bands == [16, 32, 64, 128]
    assert stats.kv_blocks_by_prompt_len == [1, 0, 3, 0]
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.core.stats().kv_blocks_by_prompt_len == [0, 0, 0, 0]
