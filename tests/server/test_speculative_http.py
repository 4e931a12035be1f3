"""A server whose engine speculates (n-gram drafts): completions, streamed and not, give
the tokens of an engine that does not, and ``/metrics`` carries the spec_decode
counters, which grow with accepted drafts."""

from __future__ import annotations

import json

import httpx
import pytest
from prometheus_text import parse, value
from quire.config import EngineConfig
from quire.engine import LLMEngine
from quire.entrypoints.server.app import create_app
from quire.entrypoints.server.async_engine import AsyncEngine
from quire.sampling_params import SamplingParams
from server_thread import Server

MODEL = "tiny"
PROMPT = [12, 7, 7, 12, 7, 7, 12, 7]  # the tiny model's greedy output repeats: drafts pass
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def expected(tiny_checkpoint):
    """Greedy tokens and text without speculation."""
    engine = LLMEngine(EngineConfig.from_kwargs(str(tiny_checkpoint("llama")), device="cpu"))
    engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                       request_id="probe")
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                result = out.outputs[0]
    engine.shutdown()
    return result.token_ids, result.text


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    engine = LLMEngine(EngineConfig.from_kwargs(str(tiny_checkpoint("llama")), device="cpu",
                                                speculative_config=SPEC))
    srv = Server(create_app(AsyncEngine(engine), MODEL))
    yield srv
    srv.stop()


def _completion(server, stream: bool) -> str:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    if not stream:
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    text = ""
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[len("data: "):])
                text += "".join(c["text"] for c in chunk["choices"])
    return text


def test_completions_equal_the_engine_s_without_speculation_and_count_drafts(server,
                                                                            expected):
    _, want = expected
    before, _, _ = parse(httpx.get(server.url + "/metrics", timeout=30).text)
    assert _completion(server, stream=False) == want
    assert _completion(server, stream=True) == want
    samples, types, _ = parse(httpx.get(server.url + "/metrics", timeout=30).text)
    assert types["quire:spec_decode_num_drafts_total"] == "counter"
    ours = {"engine": "0", "model": MODEL}
    drafts = value(samples, "quire:spec_decode_num_draft_tokens_total", **ours) \
        - value(before, "quire:spec_decode_num_draft_tokens_total", **ours)
    accepted = value(samples, "quire:spec_decode_num_accepted_tokens_total", **ours) \
        - value(before, "quire:spec_decode_num_accepted_tokens_total", **ours)
    assert drafts >= accepted > 0
    per_pos = sum(value(samples, "quire:spec_decode_num_accepted_tokens_per_pos_total",
                        engine="0", model=MODEL, position=str(i)) for i in range(3))
    assert per_pos == value(samples, "quire:spec_decode_num_accepted_tokens_total",
                            engine="0", model=MODEL)
