"""Structured outputs offline: the mask does not disturb the model (greedy under a grammar
that allows what the model says equals no grammar, on SmolLM2), grammars hold through
preemption, forked samples and an engine core in another process, and a bad grammar is
refused before anything runs."""

from __future__ import annotations

import json
import re

import pytest
from quire import LLM, SamplingParams

REGEX = r"[a-z]{2,5}( [a-z]{2,5}){0,3}\."


def test_a_grammar_allowing_everything_leaves_greedy_output_unchanged(smollm2_gguf):
    prompts = ["The capital of France is", "List three fruits:", "def add(a, b):",
               "Once upon a time"]
    with LLM(str(smollm2_gguf), device="cpu", max_model_len=256) as llm:
        free = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32))
        masked = llm.generate(prompts, SamplingParams(
            temperature=0, max_tokens=32, structured_outputs={"regex": r"(?s:.*)"}))
    for a, b in zip(free, masked):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids, (a.prompt, b.outputs[0].text)


def test_json_on_smollm2_parses_at_temperature_one(smollm2_gguf):
    """Nested objects, arrays, enums, required fields; numbers bounded (a 135M model at
    temperature 1 otherwise writes digits until max_tokens, which the schema allows)."""
    schema = {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30},
        "population": {"type": "integer", "minimum": 0, "maximum": 10**9},
        "climate": {"enum": ["cold", "mild", "hot"]},
        "mayor": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 30},
            "since": {"type": "integer", "minimum": 1900, "maximum": 2030}},
            "required": ["name"], "additionalProperties": False},
        "districts": {"type": "array", "items": {"type": "string", "maxLength": 20},
                      "maxItems": 3}},
        "required": ["city", "population", "climate", "mayor"],
        "additionalProperties": False}
    with LLM(str(smollm2_gguf), device="cpu", max_model_len=512) as llm:
        outs = llm.generate(["A city as JSON:"] * 20, [SamplingParams(
            temperature=1.0, seed=i, max_tokens=300, structured_outputs={"json": schema})
            for i in range(20)])
    for out in outs:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        data = json.loads(out.outputs[0].text)
        assert set(data) >= {"city", "population", "climate", "mayor"}
        assert data["climate"] in ("cold", "mild", "hot") and "name" in data["mayor"]
        assert 0 <= data["population"] <= 10**9


def test_grammars_hold_through_preemption_and_samples(tiny_checkpoint):
    path = str(tiny_checkpoint("llama"))
    with LLM(path, device="cpu", block_size=4) as probe:
        page = probe.engine.core.executor.bytes_per_block()
    with LLM(path, device="cpu", block_size=4, kv_cache_memory=24 * page) as llm:
        outs = llm.generate([list(range(3, 20)), list(range(30, 45))] * 3, SamplingParams(
            n=2, temperature=1.0, seed=5, max_tokens=40,
            structured_outputs={"regex": REGEX}))
        assert llm.engine.core.scheduler.stats.num_preemptions > 0
    for out in outs:
        for c in out.outputs:
            assert re.fullmatch(REGEX, c.text), c.text


def test_grammars_in_an_engine_core_process(tiny_checkpoint):
    with LLM(str(tiny_checkpoint("llama")), device="cpu", data_parallel_size=2) as llm:
        outs = llm.generate(["a", "b", "c", "d"], SamplingParams(
            temperature=1.0, seed=2, max_tokens=40, structured_outputs={"regex": REGEX}))
    assert all(re.fullmatch(REGEX, o.outputs[0].text) for o in outs)


def test_a_bad_grammar_is_refused_before_anything_runs(tiny_checkpoint):
    with LLM(str(tiny_checkpoint("llama")), device="cpu") as llm:
        with pytest.raises(ValueError, match=r"structured_outputs\.regex"):
            llm.generate(["a"], SamplingParams(structured_outputs={"regex": "a(b"}))
        assert not llm.engine.has_unfinished_requests()
        assert llm.generate(["a"], SamplingParams(max_tokens=2))[0].outputs[0].token_ids


def test_a_grammar_holds_only_the_answer_after_the_thinking(tiny_checkpoint):
    """Two token ids stand in for <think> and </think>: the first token may open the
    thinking (a bias makes it), nothing is masked until the end marker (a bias makes it
    come soon), and then the grammar holds the answer."""
    from quire.config import EngineConfig
    from quire.engine import LLMEngine
    from quire.engine.messages import ThinkingTokens

    start, end = 300, 301
    engine = LLMEngine(EngineConfig.from_kwargs(str(tiny_checkpoint("llama")), device="cpu"))
    try:
        digits = {"regex": "[0-9]{3}"}
        for seed in range(4):
            engine.add_request([5, 6, 7], SamplingParams(
                temperature=1.0, seed=seed, max_tokens=80, structured_outputs=digits,
                logit_bias={start: 10.0, end: 10.0}),
                thinking=ThinkingTokens(end=end, start=start))
        # answering at once: the start marker is only a choice for the first token
        engine.add_request([5, 6, 7], SamplingParams(
            temperature=1.0, seed=9, max_tokens=20, structured_outputs=digits),
            thinking=ThinkingTokens(end=end, start=start))
        outs = []
        while engine.has_unfinished_requests():
            outs += [o for o in engine.step() if o.finished]
    finally:
        engine.shutdown()
    decode = engine.tokenizer.decode
    for out in outs:
        ids = out.outputs[0].token_ids
        if ids[0] == start:
            assert end in ids, ids
            answer = ids[ids.index(end) + 1:]
            assert ids.index(end) >= 1
        else:
            answer = ids
        assert re.fullmatch("[0-9]{3}", decode(answer)), (ids, decode(answer))
        assert out.outputs[0].finish_reason == "stop"
    assert sum(o.outputs[0].token_ids[0] == start for o in outs) == 4
