"""Two models in one ``quire serve``: requests go by their ``model`` field, 60 concurrent
requests alternating between the models each get the text the model gives alone, the
models' KV pools stay within one budget, and every process is one per model."""

from __future__ import annotations

import asyncio
import threading

import httpx
import openai
import pytest
from quire import LLM, SamplingParams
from quire.config import EngineConfig
from quire.engine import LLMEngine
from serve_process import ServeProcess, metric_sum

NAMES = ("alpha", "beta")
PROMPTS = ["The capital of France is", "Once upon a time", "Paged attention keeps",
           "A quire of pages", "Fishermen told stories", "Attention is all"]
#: pages of 16 tokens both models share: less than their 8 + 8 running sequences need
BUDGET_PAGES = 40


def _jobs() -> list[tuple[str, str, int]]:
    """60 requests alternating between the models: (model, prompt, max_tokens)."""
    return [(NAMES[i % 2], PROMPTS[i % len(PROMPTS)], 24 + (i * 7) % 33) for i in range(60)]


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint):
    return str(tiny_checkpoint("llama")), str(tiny_checkpoint("qwen3"))


@pytest.fixture(scope="module")
def alone(checkpoints) -> dict[tuple[str, str, int], str]:
    """Each job's greedy text from its model alone, offline."""
    out = {}
    for name, path in zip(NAMES, checkpoints):
        llm = LLM(path, device="cpu", max_model_len=256)
        jobs = sorted({j for j in _jobs() if j[0] == name})
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
                  for _, _, m in jobs]
        for job, result in zip(jobs, llm.generate([p for _, p, _ in jobs], params)):
            out[job] = result.outputs[0].text
        llm.shutdown()
    return out


@pytest.fixture(scope="module")
def server(checkpoints):
    page = 0
    for path in checkpoints:
        engine = LLMEngine(EngineConfig(model=path, device="cpu", kv_cache_memory=1 << 20))
        page = max(page, engine.core.executor.bytes_per_block())
        engine.shutdown()
    srv = ServeProcess("--model", checkpoints[0], "--model", checkpoints[1],
                       "--served-model-name", *NAMES, "--kv-cache-memory",
                       str(BUDGET_PAGES * page), "--max-num-seqs", "8",
                       "--max-model-len", "256", "--block-size", "16")
    yield srv
    srv.stop()


def test_sixty_concurrent_requests_alternating_two_models_match_each_alone(server, alone):
    scrapes: list[str] = []
    stop = threading.Event()

    def scrape() -> None:
        while not stop.is_set():
            scrapes.append(httpx.get(server.url + "/metrics", timeout=30).text)
            stop.wait(0.05)

    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none",
                                    max_retries=0, timeout=300)
        async def one(model: str, prompt: str, max_tokens: int) -> str:
            r = await client.completions.create(model=model, prompt=prompt,
                                                max_tokens=max_tokens, temperature=0,
                                                extra_body={"ignore_eos": True})
            assert r.model == model
            return r.choices[0].text
        try:
            return await asyncio.gather(*(one(*job) for job in _jobs()))
        finally:
            await client.close()

    watcher = threading.Thread(target=scrape)
    watcher.start()
    try:
        texts = asyncio.run(run())
    finally:
        stop.set()
        watcher.join()
    scrapes.append(httpx.get(server.url + "/metrics", timeout=30).text)
    assert texts == [alone[job] for job in _jobs()]
    assert scrapes
    for text in scrapes:  # the two pools within one budget at every scrape
        budget = metric_sum(text, f'quire:kv_budget_bytes{{model="{NAMES[0]}"}}')
        assert metric_sum(text, f'quire:kv_budget_bytes{{model="{NAMES[1]}"}}') == budget
        assert metric_sum(text, "quire:kv_held_bytes") <= budget
    # the budget bound them: together they held most of it, each a part
    busy = max(scrapes, key=lambda t: metric_sum(t, "quire:kv_held_bytes"))
    assert metric_sum(busy, "quire:kv_held_bytes") >= 0.9 * budget
    for name in NAMES:
        assert metric_sum(busy, f'quire:kv_held_bytes{{model="{name}"}}') > 0
    final = scrapes[-1]
    for name in NAMES:
        assert metric_sum(final, f'quire:request_success_total{{model="{name}"}}') >= 30
    assert metric_sum(final, 'quire:processes{role="engine_core"}') == 2


def test_models_are_listed_and_an_unknown_one_is_a_404_naming_them(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    assert [m.id for m in client.models.list().data] == list(NAMES)
    with pytest.raises(openai.NotFoundError) as excinfo:
        client.completions.create(model="gamma", prompt="hi", max_tokens=2)
    message = excinfo.value.body["message"]
    assert "'gamma' does not exist" in message and all(n in message for n in NAMES)
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    roles = sorted(server.descendants().values())
    assert roles.count("core") == 2
