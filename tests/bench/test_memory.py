"""The KV memory simulation, on cases small enough to work out by hand."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from quire.bench.corpus import Prompt
from quire.bench.memory import (
    KVBudget,
    compare,
    kv_bytes_per_token,
    simulate_contiguous,
    simulate_paged,
)
from quire.bench.workloads import BenchRequest


def request(tokens: list[int], output_len: int) -> BenchRequest:
    return BenchRequest(Prompt("", tuple(tokens)), output_len)


def distinct(n: int, prompt_len: int, output_len: int) -> list[BenchRequest]:
    return [request([1000 * i + t for t in range(prompt_len)], output_len) for i in range(n)]


def test_paged_against_contiguous_by_hand():
    # 4 requests of 10 prompt + 7 output tokens: at most 16 tokens in KV each (the last
    # sampled token is never written), so one 16-token page each; 64 tokens of budget.
    paged, at_max, at_need = compare(distinct(4, 10, 7), budget_tokens=64, block_size=16,
                                     max_model_len=32)
    # paged: all four at once for 7 steps, holding 4 pages while 10..16 tokens fill each
    assert (paged.peak_concurrency, paged.mean_concurrency, paged.steps) == (4, 4.0, 7)
    assert paged.waste_share == pytest.approx(84 / 448)  # 1 - 4*(10+...+16) / (64*7)
    assert paged.preemptions == 0
    # max_model_len=32 each: two at a time, twice as many steps; 32 - (10..16) wasted
    assert (at_max.peak_concurrency, at_max.mean_concurrency, at_max.steps) == (2, 2.0, 14)
    assert at_max.waste_share == pytest.approx(1 - 364 / 896)
    # prompt + max_tokens = 17 each: three fit in 64, the fourth runs alone afterwards
    assert (at_need.peak_concurrency, at_need.mean_concurrency, at_need.steps) == (3, 2.0, 14)
    assert at_need.waste_share == pytest.approx(1 - 364 / 476)


def test_paged_shares_full_prompt_pages():
    shared = list(range(1, 9))  # two full 4-token pages
    requests = [request(shared + [50, 51], 1), request(shared + [60, 61], 1)]
    cached = simulate_paged(requests, budget_tokens=64, block_size=4)
    # pages: 2 shared + one partial each = 4 pages, 16 slots, 8 + 2 + 2 filled
    assert cached.filled_share == pytest.approx(12 / 64)
    assert cached.waste_share == pytest.approx(4 / 16)
    alone = simulate_paged(requests, budget_tokens=64, block_size=4,
                           enable_prefix_caching=False)
    assert alone.filled_share == pytest.approx(20 / 64)
    assert alone.waste_share == pytest.approx(4 / 24)


def test_paged_preempts_when_growth_outruns_the_pool():
    # 3 pages of 4 tokens; two sequences of 4 + 6 need 3 pages each at the end
    result = simulate_paged(distinct(2, 4, 6), budget_tokens=12, block_size=4)
    assert result.preemptions >= 1
    assert result.peak_concurrency == 2


def test_requests_that_can_never_fit_are_named():
    with pytest.raises(ValueError, match="request 0"):
        simulate_paged(distinct(1, 40, 10), budget_tokens=32, block_size=16)
    with pytest.raises(ValueError, match="request 0 needs 50 tokens"):
        simulate_contiguous(distinct(1, 40, 10), 64, lambda r: 32, "contiguous")


def test_budgets_parse_tokens_and_bytes():
    assert KVBudget.parse("8192tok") == KVBudget(tokens=8192)
    assert KVBudget.parse("100 tokens").to_tokens(None) == 100
    assert KVBudget.parse("2GiB") == KVBudget(bytes=2 << 30)
    assert KVBudget.parse("1000").to_tokens(10) == 100
    with pytest.raises(ValueError, match="bytes per token"):
        KVBudget.parse("1GB").to_tokens(None)
    with pytest.raises(ValueError, match="expected tokens"):
        KVBudget.parse("lots")


def test_kv_bytes_per_token_from_a_config():
    smollm2 = SimpleNamespace(num_hidden_layers=30, num_attention_heads=9,
                              num_key_value_heads=3, head_dim=64, hidden_size=576)
    assert kv_bytes_per_token(smollm2, dtype_bytes=4) == 2 * 30 * 3 * 64 * 4
    # int8/fp8 pages: a float16 scale per 16 values beside each row
    assert kv_bytes_per_token(smollm2, dtype_bytes=1, quantized=True) == 2 * 30 * 3 * 72
