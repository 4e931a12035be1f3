"""``GET /metrics`` end to end: uvicorn in a thread, a tiny model, Prometheus text parsed
back. Counters are compared as differences between two scrapes, so the tests do not
depend on each other's order. Every wait is bounded."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
import prometheus_text
from prometheus_text import parse
from quire.config import EngineConfig
from quire.engine import EngineStats, LLMEngine
from quire.entrypoints.server.app import create_app
from quire.entrypoints.server.async_engine import AsyncEngine, _Stop
from quire.sampling_params import SamplingParams
from server_thread import Server
from starlette.testclient import TestClient

MODEL = "tiny"
KEY = "secret"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                 "{% endfor %}assistant:")
PROMPT_IDS = [5, 6, 7, 8, 9]
#: Histograms observed once per finished request.
PER_REQUEST = ("quire:e2e_request_latency_seconds", "quire:request_queue_time_seconds",
               "quire:request_prompt_tokens", "quire:request_generation_tokens")


def greedy_first_token(engine: LLMEngine, ids: list[int]) -> int:
    """The token greedy decoding picks first after ``ids`` (run before serving)."""
    engine.add_request(ids, SamplingParams(temperature=0, max_tokens=1), request_id="probe")
    for _ in range(10):
        for out in engine.step():
            if out.finished:
                return out.outputs[0].token_ids[0]
    raise AssertionError("the probe request did not finish")


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    path = str(tiny_checkpoint("llama"))
    engine = LLMEngine(EngineConfig.from_kwargs(path, device="cpu", max_model_len=128))
    stop_token = greedy_first_token(engine, PROMPT_IDS)
    step_delay = [0.0]  # seconds added to each step, to catch a request mid-run
    fast_step = engine.step

    def step(final_only: bool = False, timeout: float = 0.1):
        time.sleep(step_delay[0])
        return fast_step(final_only, timeout)

    engine.step = step
    aengine = AsyncEngine(engine, max_waiting_requests=8)
    srv = Server(create_app(aengine, MODEL, api_key=KEY, chat_template=CHAT_TEMPLATE))
    srv.engine, srv.step_delay, srv.stop_token = aengine, step_delay, stop_token
    yield srv
    srv.stop()


def post(server, path: str, body: dict) -> httpx.Response:
    r = httpx.post(server.url + path, json={"model": MODEL, **body}, timeout=30,
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text
    return r


def scrape(server) -> dict:
    r = httpx.get(server.url + "/metrics", timeout=30)  # no API key needed
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == CONTENT_TYPE
    return parse(r.text)[0]


def value(samples: dict, name: str, **labels: str) -> float:
    """A sample of the served model: every sample is labelled with its name."""
    return prometheus_text.value(samples, name, model=MODEL, **labels)


def delta(after: dict, before: dict, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def wait_idle(server, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(server)
        if (value(samples, "quire:num_requests_running", engine="0") == 0
                and value(samples, "quire:num_requests_waiting", engine="0") == 0
                and value(samples, "quire:num_kv_blocks_used", engine="0") == 0):
            return samples
        assert time.monotonic() < deadline, "the engine did not go idle"
        time.sleep(0.05)


def test_every_metric_is_exposed_with_its_type(server):
    r = httpx.get(server.url + "/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"] == CONTENT_TYPE
    _, types, helps = parse(r.text)
    gauges = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
              "kv_cache_usage_by_prompt_len_perc", "num_kv_blocks_used", "num_kv_blocks_total", "prefix_cache_hit_rate",
              "processes"]
    counters = ["prefix_cache_queries_total", "prefix_cache_hits_total",
                "num_preemptions_total", "engine_requests_total", "prompt_tokens_total",
                "generation_tokens_total",
                "request_success_total", "request_slo_missed_total"]
    histograms = ["time_to_first_token_seconds", "inter_token_latency_seconds",
                  "e2e_request_latency_seconds", "request_queue_time_seconds",
                  "request_prompt_tokens", "request_generation_tokens",
                  "time_to_first_token_by_prompt_len_seconds",
                  "request_queue_time_by_prompt_len_seconds"]
    expected = {**{f"quire:{n}": "gauge" for n in gauges},
                **{f"quire:{n}": "counter" for n in counters},
                **{f"quire:{n}": "histogram" for n in histograms}}
    assert types == expected
    assert set(helps) == set(expected) and all(helps.values())


def test_counters_match_the_usage_responses_reported(server):
    before = wait_idle(server, timeout=10)
    usages, reasons, single = [], [], []
    # "length": a whole completion and a streamed chat with usage
    r = post(server, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 5,
                                         "temperature": 0, "ignore_eos": True}).json()
    usages.append(r["usage"]), reasons.append("length"), single.append(r["usage"])
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=30,
                      headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                            "max_tokens": 3, "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True}}) as s:
        assert s.status_code == 200
        chunks = [json.loads(line[6:]) for line in s.iter_lines()
                  if line.startswith("data: {")]
    usages.append(chunks[-1]["usage"]), reasons.append("length"), single.append(usages[-1])
    # "stop": greedy picks the stop token first
    r = post(server, "/v1/completions", {"prompt": PROMPT_IDS, "max_tokens": 5,
                                         "temperature": 0,
                                         "stop_token_ids": [server.stop_token]}).json()
    assert r["choices"][0]["finish_reason"] == "stop" and r["usage"]["completion_tokens"] == 1
    usages.append(r["usage"]), reasons.append("stop"), single.append(r["usage"])
    # two samples: one request, its prompt counted once
    r = post(server, "/v1/completions", {"prompt": "Two", "max_tokens": 4, "n": 2,
                                         "seed": 3, "ignore_eos": True}).json()
    usages.append(r["usage"]), reasons.append("length")

    after = wait_idle(server, timeout=10)
    assert delta(after, before, "quire:prompt_tokens_total") == \
        sum(u["prompt_tokens"] for u in usages)
    assert delta(after, before, "quire:generation_tokens_total") == \
        sum(u["completion_tokens"] for u in usages)
    for reason in ("stop", "length", "abort"):
        assert delta(after, before, "quire:request_success_total",
                     finished_reason=reason) == reasons.count(reason), reason
    for name in PER_REQUEST:
        assert delta(after, before, f"{name}_count") == len(usages), name
    assert delta(after, before, "quire:request_prompt_tokens_sum") == \
        sum(u["prompt_tokens"] for u in usages)
    assert delta(after, before, "quire:time_to_first_token_seconds_count") == len(usages)
    # one gap per token after the first for single samples; the n=2 request adds at most
    # one per extra step
    itl = delta(after, before, "quire:inter_token_latency_seconds_count")
    assert itl >= sum(u["completion_tokens"] - 1 for u in single) + 3
    assert itl <= sum(u["completion_tokens"] - 1 for u in usages)
    assert value(after, "quire:kv_cache_usage_perc", engine="0") == value(
        before, "quire:kv_cache_usage_perc", engine="0") == 0
    assert value(after, "quire:num_kv_blocks_total", engine="0") > 0
    # every admitted prompt is looked up in the prefix cache
    assert delta(after, before, "quire:prefix_cache_queries_total", engine="0") > 0
    assert 0 <= value(after, "quire:prefix_cache_hit_rate", engine="0") <= 1


def test_disconnect_mid_stream_counts_as_abort_and_frees_pages(server):
    before = wait_idle(server, timeout=10)
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 100, "stream": True,
            "ignore_eos": True}
    # 100 tokens at 50 ms a step take >= 5 s: idle within 3 s can only be the abort
    server.step_delay[0] = 0.05
    try:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30,
                          headers={"Authorization": f"Bearer {KEY}"}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # held: a dropped line iterator closes the connection
            for line in lines:
                if line.startswith("data: {"):
                    break
            mid = scrape(server)  # the engine thread answers between two steps
            assert value(mid, "quire:num_requests_running", engine="0") == 1
            assert value(mid, "quire:num_kv_blocks_used", engine="0") > 0
            assert value(mid, "quire:kv_cache_usage_perc", engine="0") > 0
            # the one sequence's pages are all its band's ("Once": the first band)
            assert value(mid, "quire:kv_cache_usage_by_prompt_len_perc", engine="0",
                         prompt_len_le="16") == value(mid, "quire:kv_cache_usage_perc",
                                                      engine="0")
            assert value(mid, "quire:kv_cache_usage_by_prompt_len_perc", engine="0",
                         prompt_len_le="32") == 0
        after = wait_idle(server, timeout=3.0)
    finally:
        server.step_delay[0] = 0.0
    assert delta(after, before, "quire:request_success_total", finished_reason="abort") == 1
    assert delta(after, before, "quire:e2e_request_latency_seconds_count") == 1
    generated = delta(after, before, "quire:generation_tokens_total")
    assert 1 <= generated < 100
    assert delta(after, before, "quire:request_generation_tokens_sum") == generated
    assert value(after, "quire:kv_cache_usage_perc", engine="0") == 0
    assert value(after, "quire:kv_cache_usage_by_prompt_len_perc", engine="0",
                 prompt_len_le="16") == 0


def test_a_busy_engine_thread_makes_the_scrape_time_out(server):
    aengine = server.engine
    gate = threading.Event()

    def blocked(engine):
        gate.wait(10)  # holds the engine thread, as a very long step would

    blocker = asyncio.run_coroutine_threadsafe(aengine.call(blocked), aengine.loop)
    try:
        fut = asyncio.run_coroutine_threadsafe(aengine.render_metrics(timeout=0.2),
                                               aengine.loop)
        with pytest.raises(TimeoutError):
            fut.result(timeout=5)
    finally:
        gate.set()
        blocker.result(timeout=5)
    scrape(server)  # answered again once the thread is free


def test_dead_engine_thread_is_503():
    # what AsyncEngine reads of an idle LLMEngine
    fake = SimpleNamespace(
        tokenizer=object(), has_unfinished_requests=lambda: False, shutdown=lambda: None,
        config=SimpleNamespace(max_model_len=16, engine=SimpleNamespace(model="fake")),
        check_health=lambda: None, process_counts=lambda: {},
        replica_stats=lambda: [EngineStats(num_running=0, num_waiting=0, kv_usage=0.0,
                                           num_used_blocks=0, num_blocks=4, num_preemptions=0,
                                           prefix_queries=0, prefix_hits=0,
                                           has_unfinished=False)])
    aengine = AsyncEngine(fake)  # type: ignore[arg-type]
    app = create_app(aengine, MODEL)
    assert TestClient(app).get("/metrics").status_code == 503  # never started
    with TestClient(app) as client:  # the lifespan starts the thread
        assert client.get("/metrics").status_code == 200
        aengine._commands.put(_Stop())
        aengine._thread.join(timeout=5)
        assert not aengine._thread.is_alive()
        r = client.get("/metrics")
        assert r.status_code == 503 and "not running" in r.text
