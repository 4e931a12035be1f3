"""The server on the real SmolLM2-135M-Instruct, started as the quick start does
(``quire serve`` with no ``--model``: the built-in default), driven by the official
``openai`` and ``anthropic`` clients."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest
from quire.model_store import DEFAULT_MODEL
from serve_process import ServeProcess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(smollm2_gguf):
    # the fixture put the model in the user's cache: `quire serve` finds it there
    srv = ServeProcess("--max-model-len", "1024", start_timeout=300)
    yield srv
    assert srv.stop() == 0


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=120,
                         max_retries=0)


def _token_count(server, **body) -> int:
    return httpx.post(server.url + "/tokenize", json=body, timeout=30).json()["count"]


def test_default_model_is_served(client):
    assert [m.id for m in client.models.list()] == [DEFAULT_MODEL]


def test_seeded_streamed_equals_whole_completion(server, client):
    args = dict(model=DEFAULT_MODEL, prompt="The three primary colors are", max_tokens=24,
                temperature=0.9, top_p=0.95, seed=1234)
    whole = client.completions.create(**args)
    chunks = list(client.completions.create(**args, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert whole.usage.prompt_tokens == _token_count(server, prompt=args["prompt"])
    assert chunks[-1].usage == whole.usage
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + \
        whole.usage.completion_tokens


def test_chat_greedy_answer_and_usage(server, client):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    whole = client.chat.completions.create(model=DEFAULT_MODEL, messages=msgs,
                                           max_tokens=32, temperature=0)
    assert "Paris" in whole.choices[0].message.content
    assert whole.usage.prompt_tokens == _token_count(server, messages=msgs)
    streamed = client.chat.completions.create(model=DEFAULT_MODEL, messages=msgs,
                                              max_tokens=32, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == whole.choices[0].message.content


def test_anthropic_messages(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="none", timeout=120,
                                 max_retries=0)
    # this client version has no temperature argument: greedy goes in the body
    args = dict(model=DEFAULT_MODEL, max_tokens=32, extra_body={"temperature": 0},
                messages=[{"role": "user", "content": "What is the capital of France?"}])
    msg = client.messages.create(**args)
    assert "Paris" in msg.content[0].text
    with client.messages.stream(**args) as stream:
        text = "".join(stream.text_stream)
    assert text == msg.content[0].text


def test_metrics_after_requests(server):
    text = httpx.get(server.url + "/metrics", timeout=30).text
    assert "quire:generation_tokens_total" in text
    assert "quire:time_to_first_token_seconds_count" in text


def test_parse_with_a_pydantic_model_on_every_seeded_sample(client):
    """``chat.completions.parse``: the schema the client derives from a pydantic model
    (strict: every field required, no extra ones), sampled at temperature 1.0."""
    from typing import Annotated, Literal

    from pydantic import BaseModel, Field

    class Mayor(BaseModel):
        name: str = Field(max_length=30)
        since: int = Field(ge=1900, le=2030)

    class City(BaseModel):
        city: str = Field(max_length=30)
        population: int = Field(ge=0, le=10**9)
        climate: Literal["cold", "mild", "hot"]
        mayor: Mayor
        districts: list[Annotated[str, Field(max_length=20)]] = Field(max_length=3)

    for seed in range(20):
        out = client.chat.completions.parse(
            model=DEFAULT_MODEL, response_format=City, temperature=1.0, seed=seed,
            max_tokens=300, messages=[{"role": "user", "content": "Describe a city."}])
        assert out.choices[0].finish_reason == "stop"
        assert isinstance(out.choices[0].message.parsed, City), out.choices[0].message
