"""The HTTP server end to end: uvicorn in a thread on an ephemeral port, a tiny model,
the official ``openai`` client. Every wait is bounded so a bug fails instead of hanging."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from quire.config import EngineConfig
from quire.engine import LLMEngine
from quire.server.app import create_app
from quire.server.async_engine import AsyncEngine

CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n"
                 "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
MODEL = "tiny"
KEY = "secret"


class Server:
    """uvicorn serving ``app`` in a daemon thread on an ephemeral port."""

    def __init__(self, app, engine: AsyncEngine) -> None:
        self.engine = engine
        self.uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0,
                                                log_level="warning"))
        self.uv.install_signal_handlers = lambda: None  # signals belong to the main thread
        self.thread = threading.Thread(target=self.uv.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.uv.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "no start"
            time.sleep(0.02)
        port = self.uv.servers[0].sockets[0].getsockname()[1]  # port 0: read it back
        self.url = f"http://127.0.0.1:{port}"

    def stats(self):
        fut = asyncio.run_coroutine_threadsafe(self.engine.stats(), self.engine.loop)
        return fut.result(timeout=10)

    def stop(self) -> None:
        self.uv.should_exit = True
        self.thread.join(timeout=30)
        assert not self.thread.is_alive()


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    path = str(tiny_checkpoint("llama"))
    engine = LLMEngine(EngineConfig.from_kwargs(path, device="cpu", max_model_len=128))
    # a test may slow each step down (seconds in step_delay[0]) to catch a request mid-run,
    # or, while `hold` is set, let one step run and hold the engine thread before the next
    step_delay = [0.0]
    hold = threading.Event()
    steps_since_hold = [0]
    fast_step = engine.step

    def step(final_only: bool = False):
        while hold.is_set() and steps_since_hold[0] >= 1:
            time.sleep(0.005)
        if hold.is_set():
            steps_since_hold[0] += 1
        time.sleep(step_delay[0])
        return fast_step(final_only)

    engine.step = step
    aengine = AsyncEngine(engine, max_waiting_requests=8)
    app = create_app(aengine, MODEL, api_key=KEY, max_body_bytes=20_000,
                     chat_template=CHAT_TEMPLATE)
    srv = Server(app, aengine)
    srv.step_delay = step_delay
    srv.hold = hold
    srv.steps_since_hold = steps_since_hold
    srv.block_manager = engine.block_manager
    yield srv
    srv.stop()
    assert not aengine._thread.is_alive()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, timeout=30, max_retries=0)


def http(server, method, path, **kw):
    headers = kw.pop("headers", {"Authorization": f"Bearer {KEY}"})
    return httpx.request(method, server.url + path, headers=headers, timeout=30, **kw)


def wait_idle(server, timeout=10.0):
    deadline = time.monotonic() + timeout
    while True:
        stats = server.stats()
        if stats.num_used_blocks == 0 and not stats.has_unfinished:
            return stats
        assert time.monotonic() < deadline, f"pages still held: {stats}"
        time.sleep(0.05)


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
