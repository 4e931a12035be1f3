"""Beam search over ``/v1/completions`` (vLLM's ``use_beam_search`` extra parameters):
the choices equal ``LLM.beam_search``'s best beams, streamed or not (a stream gets the
beams in one final chunk); options beam search does not run are 400s naming the field."""

from __future__ import annotations

import json

import httpx
import pytest
from quire import LLM, BeamSearchParams
from quire.config import EngineConfig
from quire.engine import LLMEngine
from quire.entrypoints.server.app import create_app
from quire.entrypoints.server.async_engine import AsyncEngine
from server_thread import Server

MODEL = "tiny"
PROMPT = [1, 5, 9, 33, 71, 100, 7]
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                 "{% endfor %}assistant:")


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    engine = LLMEngine(EngineConfig.from_kwargs(str(tiny_checkpoint("llama")), device="cpu",
                                                dtype="float32", max_model_len=256))
    aengine = AsyncEngine(engine)
    srv = Server(create_app(aengine, MODEL, chat_template=CHAT_TEMPLATE), aengine)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def expected(tiny_checkpoint):
    with LLM(str(tiny_checkpoint("llama")), device="cpu", dtype="float32",
             max_model_len=256) as llm:
        [out] = llm.beam_search([{"prompt_token_ids": PROMPT}],
                                BeamSearchParams(3, 8, length_penalty=0.5))
    return out.sequences


def _body(**extra):
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "use_beam_search": True,
            "n": 2, "best_of": 3, "length_penalty": 0.5, **extra}


def test_completions_beams_equal_llm_beam_search(server, expected):
    r = httpx.post(server.url + "/v1/completions", json=_body(), timeout=60)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert [c["text"] for c in choices] == [s.text for s in expected[:2]]
    assert [c["finish_reason"] for c in choices] == [s.finish_reason for s in expected[:2]]
    assert r.json()["usage"]["completion_tokens"] == sum(
        len(s.tokens) - len(PROMPT) for s in expected[:2])


def test_streamed_beams_come_in_one_final_chunk(server, expected):
    texts: dict[int, list[str]] = {}
    with httpx.stream("POST", server.url + "/v1/completions", json=_body(stream=True),
                      timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:])["choices"]:
                if c["text"]:
                    texts.setdefault(c["index"], []).append(c["text"])
    assert texts == {i: [s.text] for i, s in enumerate(expected[:2]) if s.text}


@pytest.mark.parametrize("extra,param", [
    ({"top_p": 0.5}, "top_p"), ({"logprobs": 1}, "logprobs"), ({"stop": ["a"]}, "stop"),
    ({"early_stopping": "sometimes"}, "early_stopping"), ({"best_of": 1}, "best_of"),
    ({"use_beam_search": False, "temperature": 0, "n": 1}, "best_of"),
    ({"length_penalty": "long"}, "length_penalty"), ({"best_of": 10**6}, "best_of")])
def test_bad_beam_fields_are_400s_naming_them(server, extra, param):
    r = httpx.post(server.url + "/v1/completions", json=_body(**extra), timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_chat_beams_equal_completions_on_the_rendered_prompt(server):
    """Chat takes the same fields: its beams are the completions' beams of the prompt
    its template renders."""
    fields = {"model": MODEL, "max_tokens": 6, "use_beam_search": True, "n": 2,
              "best_of": 3}
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        **fields, "messages": [{"role": "user", "content": "a tale"}]})
    assert chat.status_code == 200, chat.text
    rendered = httpx.post(server.url + "/tokenize", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "a tale"}]}).json()
    completion = httpx.post(server.url + "/v1/completions", timeout=60, json={
        **fields, "prompt": rendered["tokens"]})
    assert [c["message"]["content"] for c in chat.json()["choices"]] == \
        [c["text"] for c in completion.json()["choices"]]
    bad = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        **fields, "messages": [{"role": "user", "content": "a tale"}], "top_k": 3})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_k"


def test_best_of_sampling_returns_the_likeliest_samples(server):
    """Without beam search, ``best_of`` samples are drawn and the ``n`` of highest
    cumulative logprob returned (vLLM's): here the best 2 of the 4 samples that ``n=4``
    with the same seed draws."""
    fields = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 1.0,
              "seed": 7, "logprobs": 0}
    every = httpx.post(server.url + "/v1/completions", timeout=60,
                       json={**fields, "n": 4}).json()["choices"]
    best = httpx.post(server.url + "/v1/completions", timeout=60,
                      json={**fields, "n": 2, "best_of": 4}).json()["choices"]
    ranked = sorted(every, key=lambda c: -sum(c["logprobs"]["token_logprobs"]))
    assert [c["text"] for c in best] == [c["text"] for c in ranked[:2]]
    assert [c["index"] for c in best] == [0, 1]
    texts: dict[int, str] = {}
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
            **fields, "n": 2, "best_of": 4, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert texts == {0: best[0]["text"], 1: best[1]["text"]}
