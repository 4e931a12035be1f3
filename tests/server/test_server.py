"""The HTTP server end to end: uvicorn in a thread on an ephemeral port, a tiny model,
the official ``openai`` client. Every wait is bounded so a bug fails instead of hanging."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from quire.config import EngineConfig
from quire.engine import LLMEngine
from quire.entrypoints.server.app import create_app
from quire.entrypoints.server.limits import ServerLimits
from server_thread import serve_stepped, wait_idle

CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n"
                 "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
MODEL = "tiny"
KEY = "secret"


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    path = str(tiny_checkpoint("llama"))
    engine = LLMEngine(EngineConfig.from_kwargs(path, device="cpu", max_model_len=128))
    # a test may slow each step down (seconds in step_delay[0]) to catch a request mid-run,
    # or, while `hold` is set, let one step run and hold the engine thread before the next
    srv = serve_stepped(engine, lambda aengine: create_app(
        aengine, MODEL, api_key=KEY, limits=ServerLimits(max_body_bytes=20_000),
            chat_template=CHAT_TEMPLATE),
        max_waiting_requests=8)
    yield srv
    srv.stop()
    assert not srv.engine._thread.is_alive()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, timeout=30, max_retries=0)


def http(server, method, path, **kw):
    headers = kw.pop("headers", {"Authorization": f"Bearer {KEY}"})
    timeout = kw.pop("timeout", 30)
    return httpx.request(method, server.url + path, headers=headers, timeout=timeout, **kw)


def test_models_health_version(server, client):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert http(server, "GET", "/health").status_code == 200
    assert http(server, "GET", "/version").json()["version"]


def test_completion_whole_and_streamed_agree(client):
    args = dict(
        model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0.8, seed=7,
        extra_body={"ignore_eos": True})
    whole = client.completions.create(**args)
    assert whole.usage.completion_tokens == 8
    assert whole.usage.prompt_tokens > 0
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 8
    chunks = list(client.completions.create(**args, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == 8
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_allowed_token_ids_and_bad_words(server, client):
    tok = server.engine.tokenizer
    args = dict(model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=0)
    only = client.completions.create(**args, extra_body={"ignore_eos": True,
                                                         "allowed_token_ids": [42]})
    assert only.choices[0].text == tok.decode([42] * 4)
    free = client.completions.create(**args, extra_body={"ignore_eos": True})
    word = free.choices[0].text.split()[0]
    banned = client.completions.create(**args, extra_body={"ignore_eos": True,
                                                           "bad_words": [word]})
    assert banned.choices[0].text != free.choices[0].text


def test_chat_whole_streamed_n2_and_logprobs(client):
    msgs = [{"role": "user", "content": "Paris?"}]
    whole = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5,
                                           temperature=0, logprobs=True, top_logprobs=2,
                                           extra_body={"ignore_eos": True})
    assert whole.usage.completion_tokens == 5
    content = whole.choices[0].logprobs.content
    assert len(content) == 5 and len(content[0].top_logprobs) == 2
    streamed = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5,
                                              temperature=0, stream=True,
                                              extra_body={"ignore_eos": True})
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == whole.choices[0].message.content
    two = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, n=2,
                                         seed=1, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in two.choices) == [0, 1]
    assert two.usage.completion_tokens == 8


@pytest.mark.parametrize("body,param", [
    ({"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "hi", "n": 100000}, "n"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"prompt": "hi", "top_p": 5}, "top_p"),
    ({"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": "hi", "allowed_token_ids": []}, "allowed_token_ids"),
    ({"prompt": "hi", "allowed_token_ids": ["a"]}, "allowed_token_ids"),
    ({"prompt": "hi", "allowed_token_ids": [10**9]}, "allowed_token_ids"),
    ({"prompt": "hi", "allowed_token_ids": 3}, "allowed_token_ids"),
    ({"prompt": "hi", "bad_words": [""]}, "bad_words"),
    ({"prompt": "hi", "bad_words": [7]}, "bad_words"),
    ({"prompt": "hi", "bad_words": [f"w{i}" for i in range(1000)]}, "bad_words"),
])
def test_bad_parameters_are_400_naming_the_field(server, body, param):
    r = http(server, "POST", "/v1/completions", json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param


def test_other_errors_and_server_keeps_answering(server, client):
    r = http(server, "POST", "/v1/completions", content=b"{not json")
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = http(server, "POST", "/v1/completions", json={"model": "nope", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = http(server, "POST", "/v1/completions", json={"model": MODEL, "prompt": [5] * 500})
    assert r.status_code == 400 and "max_model_len" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "prompt"
    r = http(server, "POST", "/v1/completions", content=b"x" * 30_000)
    assert r.status_code == 413
    r = http(server, "GET", "/v1/models", headers={})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = http(server, "GET", "/v1/models", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="hi", max_tokens=1)
    ok = client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert ok.choices[0].finish_reason in ("length", "stop")
    wait_idle(server)


def test_tokenize_detokenize(server):
    ids = http(server, "POST", "/tokenize", json={"prompt": "Paris"}).json()["tokens"]
    assert http(server, "POST", "/detokenize", json={"tokens": ids}).json()["prompt"] \
        .endswith("Paris")


def test_disconnect_mid_stream_frees_pages(server):
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 100, "stream": True,
            "ignore_eos": True}
    # 100 tokens at 50 ms a step take >= 5 s; pages back within 2 s can only be the abort
    server.step_delay[0] = 0.05
    server.steps_since_hold[0] = 0
    server.hold.set()  # one step (the prompt and first token) runs, then the engine waits
    try:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30,
                          headers={"Authorization": f"Bearer {KEY}"}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    json.loads(line[6:])
                    break
            # read directly: the engine thread is paused and cannot answer stats()
            assert server.block_manager.num_used_blocks > 0
        server.hold.clear()  # the client is gone; let the engine see it
        wait_idle(server, timeout=2.0)
    finally:
        server.hold.clear()
        server.step_delay[0] = 0.0


def test_overload_is_503_with_retry_after(server):
    engine = server.engine
    saved = engine.max_waiting_requests
    engine.max_waiting_requests = 0  # every request is over the bound
    try:
        r = http(server, "POST", "/v1/completions",
                 json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
    finally:
        engine.max_waiting_requests = saved
    assert r.status_code == 503 and r.headers["retry-after"]
    assert r.json()["error"]["code"] == "overloaded"


def test_several_prompts_in_one_completions_request(server, client):
    prompts = ["Once upon a time", "The weather", "A B C"]
    # seeded sampling: each prompt's choices are the same alone or in the batch
    args = dict(model=MODEL, max_tokens=4, n=2, seed=5, extra_body={"ignore_eos": True})
    single = [client.completions.create(prompt=p, **args) for p in prompts]
    batch = client.completions.create(prompt=prompts, **args)
    # prompt i's choices are numbered i*n .. i*n+n-1 (OpenAI's order)
    assert sorted(c.index for c in batch.choices) == list(range(6))
    by_index = {c.index: c.text for c in batch.choices}
    for i, one in enumerate(single):
        alone = {c.index: c.text for c in one.choices}
        assert (by_index[2 * i], by_index[2 * i + 1]) == (alone[0], alone[1])
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in single)
    assert batch.usage.completion_tokens == 3 * 2 * 4
    # token-id prompts and streaming of a batch: each choice's text comes out whole
    ids = http(server, "POST", "/tokenize", json={"prompt": prompts[1]}).json()["tokens"]
    chunks = list(client.completions.create(
        model=MODEL, prompt=[prompts[0], ids], max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    streamed: dict[int, str] = {}
    for c in chunks:
        for choice in c.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    greedy = [client.completions.create(model=MODEL, prompt=p, max_tokens=4, temperature=0,
                                        extra_body={"ignore_eos": True}).choices[0].text
              for p in prompts[:2]]
    assert streamed == {0: greedy[0], 1: greedy[1]}
    assert chunks[-1].usage.completion_tokens == 8
    wait_idle(server)


def test_echo_with_prompt_logprobs(server, client):
    ids = http(server, "POST", "/tokenize", json={"prompt": "Once upon"}).json()["tokens"]
    out = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=3, echo=True,
                                    logprobs=2, temperature=0, extra_body={"ignore_eos": True})
    choice = out.choices[0]
    assert choice.text.startswith("Once upon")
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + 3
    # nothing predicts the first prompt token; every other position has a logprob <= 0
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert all(len(t) >= 1 for t in lp.top_logprobs[1:])
    # the generated part equals the same request without echo
    plain = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=3,
                                      logprobs=2, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert lp.token_logprobs[len(ids):] == pytest.approx(plain.choices[0].logprobs
                                                         .token_logprobs, abs=1e-5)
    # streamed: the first chunk carries the prompt and its logprobs
    chunks = [c for c in client.completions.create(
        model=MODEL, prompt="Once upon", max_tokens=3, echo=True, logprobs=2, temperature=0,
        stream=True, extra_body={"ignore_eos": True}) if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    tokens = [t for c in chunks for t in c.choices[0].logprobs.tokens]
    assert tokens == lp.tokens


@pytest.mark.parametrize("body", [
    b'{"model": "tiny", "prompt": "caf\xff\xfe"}',  # not UTF-8 at all
    b'{"model": "tiny", "prompt": "bad \\ud800 surrogate"}',  # valid JSON, not Unicode
    b'{"model": "tiny", "prompt": ["ok", 7]}',
    b'{"model": "tiny", "prompt": []}',
    b'{"model": "tiny", "prompt": "hi", "max_tokens": 1.5}',
    b'{"model": "tiny", "prompt": "hi", "stream": "yes"}',
    b'[1, 2, 3]',
    b'',
])
def test_malformed_bodies_are_400_and_the_server_goes_on(server, client, body):
    r = http(server, "POST", "/v1/completions", content=body,
             headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    ok = client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert ok.usage.completion_tokens >= 1


def test_chat_with_lone_surrogate_is_400(server):
    r = http(server, "POST", "/v1/chat/completions",
             content=b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}]}')
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_one_access_line_per_request(server, client, caplog):
    with caplog.at_level("INFO", logger="quire.access"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=3,
                                  extra_body={"ignore_eos": True})
        list(client.completions.create(model=MODEL, prompt="hi", max_tokens=2, stream=True,
                                       extra_body={"ignore_eos": True}))
        http(server, "POST", "/v1/completions", json={"model": "nope", "prompt": "x"})
        deadline = time.monotonic() + 5  # the streamed line is written after the last byte
        while len(caplog.records) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
    lines = [r.getMessage() for r in caplog.records if r.name == "quire.access"]
    assert len(lines) == 3, lines
    assert '"POST /v1/completions" 200' in lines[0] and "completion_tokens=3" in lines[0]
    assert "id=req-" in lines[0] and "latency=" in lines[0]
    assert "completion_tokens=2" in lines[1]
    assert " 404 " in lines[2]


def test_non_streamed_request_aborted_when_client_leaves(server):
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 100, "ignore_eos": True}
    server.step_delay[0] = 0.05  # 100 steps take >= 5 s: freed within 2 s means aborted
    try:
        with pytest.raises(httpx.TimeoutException):
            http(server, "POST", "/v1/completions", json=body, timeout=0.5)
        wait_idle(server, timeout=2.0)
    finally:
        server.step_delay[0] = 0.0
