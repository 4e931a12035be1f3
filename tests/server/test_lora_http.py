"""LoRA adapters over HTTP, with the ``openai`` client: an adapter from --lora-modules
and one loaded at run time are listed in /v1/models with their parent, chosen by the
request's model field, and give, concurrently with base-model requests, the text
offline generation gives; an adapter unloaded while a request streams from it lets that
request finish with it, and later requests get a 404; refusals are 400s (or 404s) in
OpenAI's shape, naming the problem."""

from __future__ import annotations

import threading

import httpx
import pytest
from lora_adapters import make_adapter
from quire import LLM, LoRARequest
from quire.config import EngineConfig
from quire.engine import LLMEngine
from quire.entrypoints.server.app import create_app
from quire.entrypoints.server.async_engine import AsyncEngine
from quire.sampling_params import SamplingParams
from server_thread import Server, SteppedEngine

openai = pytest.importorskip("openai")
pytest.importorskip("peft")

MODEL = "tiny"
PROMPTS = ["The capital of France is", "Once upon a time there was"]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def adapters(tiny_checkpoint, tmp_path_factory):
    base = tiny_checkpoint("llama")
    root = tmp_path_factory.mktemp("lora-http")
    return base, [make_adapter(base, root / "a", 4, 8, ["q_proj", "v_proj"], False, seed=1),
                  make_adapter(base, root / "b", 8, 16, ["o_proj", "down_proj"], True,
                               seed=2)]


@pytest.fixture(scope="module")
def expected(adapters):
    """Offline text per (model name, prompt)."""
    base, (a, b) = adapters
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    texts = {}
    with LLM(str(base), device="cpu", enable_lora=True, max_loras=2) as llm:
        for name, lora in ((MODEL, None), ("static", LoRARequest("static", 1, str(a))),
                           ("dyn", LoRARequest("dyn", 2, str(b)))):
            for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params, lora_request=lora)):
                texts[name, prompt] = out.outputs[0].text
    return texts


@pytest.fixture(scope="module")
def server(adapters):
    base, (a, _) = adapters
    engine = LLMEngine(EngineConfig.from_kwargs(str(base), device="cpu", enable_lora=True,
                                                max_loras=2, max_lora_rank=8))
    stepped = SteppedEngine(engine)
    srv = Server(create_app(AsyncEngine(engine), MODEL, lora_modules=[("static", str(a))]))
    srv.stepped = stepped
    yield srv
    srv.stop()


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def _complete(client, model: str, prompt: str) -> str:
    out = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                    temperature=0, extra_body={"ignore_eos": True})
    return out.choices[0].text


def test_adapters_are_listed_chosen_by_name_and_run_beside_the_base(server, adapters,
                                                                    expected):
    base, (_, b) = adapters
    client = _client(server)
    r = httpx.post(server.url + "/v1/load_lora_adapter",
                   json={"lora_name": "dyn", "lora_path": str(b)}, timeout=30)
    assert r.status_code == 200, r.text
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {MODEL, "static", "dyn"}
    assert cards["dyn"].model_extra["parent"] == MODEL
    assert cards["dyn"].model_extra["root"] == str(b)
    results: dict[tuple[str, str], str] = {}

    def run(model: str, prompt: str) -> None:
        results[model, prompt] = _complete(client, model, prompt)

    threads = [threading.Thread(target=run, args=(m, p))
               for m in (MODEL, "static", "dyn") for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert results == expected
    assert len(set(results.values())) > len(PROMPTS)  # the adapters change the text


def test_an_adapter_unloaded_mid_stream_finishes_it_and_refuses_later_ones(server,
                                                                           adapters,
                                                                           expected):
    _, (_, b) = adapters
    client = _client(server)
    httpx.post(server.url + "/v1/load_lora_adapter",
               json={"lora_name": "late", "lora_path": str(b)}, timeout=30)
    server.stepped.step_delay[0] = 0.05  # a stream long enough to unload under it
    try:
        stream = client.completions.create(model="late", prompt=PROMPTS[0],
                                           max_tokens=MAX_TOKENS, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        text = next(chunks).choices[0].text
        r = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "late"},
                       timeout=30)
        assert r.status_code == 200, r.text
        text += "".join(c.choices[0].text for c in chunks if c.choices)
    finally:
        server.stepped.step_delay[0] = 0.0
    assert text == expected["dyn", PROMPTS[0]]  # "late" is adapter b too
    with pytest.raises(openai.NotFoundError, match="model 'late' does not exist"):
        _complete(client, "late", PROMPTS[0])
    assert "late" not in {m.id for m in client.models.list().data}


def test_refusals_name_the_problem(server, tmp_path):
    post = lambda path, body: httpx.post(server.url + path, json=body, timeout=30)  # noqa: E731
    r = post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path)})
    assert r.status_code == 400
    assert "not a LoRA adapter" in r.json()["error"]["message"]
    r = post("/v1/load_lora_adapter", {"lora_name": "static", "lora_path": str(tmp_path)})
    assert r.status_code == 400 and "is taken" in r.json()["error"]["message"]
    r = post("/v1/load_lora_adapter", {"lora_name": "y"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    r = post("/v1/unload_lora_adapter", {"lora_name": "never"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = post("/v1/completions", {"model": "never", "prompt": "x", "max_tokens": 1})
    assert r.status_code == 404
    assert "'tiny', 'static'" in r.json()["error"]["message"]


def test_a_server_without_lora_refuses_adapters(tiny_checkpoint, adapters):
    _, (a, _) = adapters
    engine = LLMEngine(EngineConfig.from_kwargs(str(tiny_checkpoint("llama")), device="cpu"))
    async_engine = AsyncEngine(engine)
    with pytest.raises(ValueError, match="LoRA is disabled: add --enable-lora"):
        create_app(async_engine, MODEL, lora_modules=[("a", str(a))])
    srv = Server(create_app(async_engine, MODEL))
    try:
        r = httpx.post(srv.url + "/v1/load_lora_adapter",
                       json={"lora_name": "a", "lora_path": str(a)}, timeout=30)
        assert r.status_code == 400 and "LoRA is disabled" in r.json()["error"]["message"]
    finally:
        srv.stop()
