"""Structured outputs over HTTP on a tiny random model (whose free text is noise, so only
the grammar can make it parse): ``response_format`` and vLLM's ``structured_outputs``
with the ``openai`` client, streamed and not, ``n > 1`` and stop strings; bad grammars
and tool requests are 400s naming the field, and the server keeps serving."""

from __future__ import annotations

import json
import re

import anthropic
import openai
import pytest
from quire.config import EngineConfig
from quire.engine import LLMEngine
from quire.entrypoints.server.app import create_app
from quire.entrypoints.server.async_engine import AsyncEngine
from server_thread import Server

MODEL = "tiny"
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                 "{% endfor %}assistant:")
# bounded, so that a random model's output always completes within max_tokens
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["cat", "dog"]},
        "legs": {"type": "integer", "minimum": 0, "maximum": 9},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
        "owner": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0,
                                                          "maximum": 99}},
                  "required": ["id"], "additionalProperties": False},
    },
    "required": ["name", "kind", "legs", "owner"],
    "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False},
}


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    engine = LLMEngine(EngineConfig.from_kwargs(str(tiny_checkpoint("llama")), device="cpu",
                                                max_model_len=256))
    aengine = AsyncEngine(engine)
    srv = Server(create_app(aengine, MODEL, chat_template=CHAT_TEMPLATE), aengine)
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                         timeout=60)


def _valid(obj: dict) -> bool:
    return (set(obj) - {"tags"} == {"name", "kind", "legs", "owner"}
            and isinstance(obj["name"], str) and len(obj["name"]) <= 6
            and obj["kind"] in ("cat", "dog") and obj["legs"] in range(10)
            and all(isinstance(t, bool) for t in obj.get("tags", []))
            and len(obj.get("tags", [])) <= 2 and set(obj["owner"]) == {"id"}
            and obj["owner"]["id"] in range(100))


def test_json_schema_parses_on_every_seeded_sample(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA,
                                                  "strict": True}}
    for seed in range(20):
        out = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "a pet"}], temperature=1.0,
            seed=seed, max_tokens=200, response_format=fmt)
        choice = out.choices[0]
        assert choice.finish_reason == "stop", choice
        assert _valid(json.loads(choice.message.content)), choice.message.content


def test_streamed_json_object_with_n_samples(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "json"}], temperature=1.0,
        seed=3, n=3, max_tokens=200, stream=True, response_format={"type": "json_object"},
        extra_body={"structured_outputs": None})
    texts = ["", "", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    for text in texts:
        assert isinstance(json.loads(text), dict), text


def test_regex_and_choice_always_match(client):
    for seed in range(10):
        out = client.completions.create(
            model=MODEL, prompt="call", temperature=1.0, seed=seed, max_tokens=30,
            extra_body={"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}})
        assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", out.choices[0].text), out.choices[0].text
        out = client.completions.create(
            model=MODEL, prompt="pick", temperature=1.0, seed=seed, max_tokens=30,
            extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
        assert out.choices[0].text in ("red", "green", "blue")
        assert out.choices[0].finish_reason == "stop"


def test_a_stop_string_still_cuts_the_output(client):
    out = client.completions.create(
        model=MODEL, prompt="x", temperature=1.0, seed=1, max_tokens=30, stop=["-"],
        extra_body={"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}})
    assert re.fullmatch(r"[0-9]{3}", out.choices[0].text)
    assert out.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objectx"}}}}, "response_format", "objectx"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs", "regex"),
    ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs", "grammar"),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs", "regexp"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
     "exactly one"),
    ({"response_format": {"type": "yaml"}}, "response_format", "yaml"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
     "both"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
     "tools", "tool calling"),
    ({"tool_choice": "required"}, "tool_choice", "tool calling"),
])
def test_what_cannot_be_honoured_is_a_400_naming_the_field(client, body, param, words):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user",
                                                               "content": "hi"}],
                                       max_tokens=4, extra_body=body)
    error = refused.value.body
    assert error["param"] == param and words in error["message"], error
    # and the server serves on
    ok = client.chat.completions.create(model=MODEL, max_tokens=2,
                                        messages=[{"role": "user", "content": "hi"}])
    assert ok.choices[0].finish_reason == "length"


def test_anthropic_tools_are_refused_in_anthropic_shape(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model=MODEL, max_tokens=4,
                               messages=[{"role": "user", "content": "hi"}],
                               tools=[{"name": "f", "input_schema": {"type": "object"}}])
    assert "tools" in str(refused.value)
