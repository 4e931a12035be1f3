"""Structured outputs and tool calls over HTTP on a tiny random model (whose free text is
noise, so only the grammar can make it parse): ``response_format`` and vLLM's
``structured_outputs`` with the ``openai`` client, streamed and not, ``n > 1`` and stop
strings; tool calls required, named and read by a parser, a round trip with the tool's
result, streamed calls equal to whole ones; bad grammars and tool requests are 400s
naming the field, and the server keeps serving."""

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
    srv = Server(create_app(aengine, MODEL, chat_template=CHAT_TEMPLATE,
                            tool_call_parser="hermes"), aengine)
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
    ({"tools": [{"type": "function", "function": {"name": 7}}]}, "tools", "tools[0]"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice",
     "not in tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "response_format", "give one"),
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


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"],
        "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
    "additionalProperties": False}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def _check_call(call, names=("get_weather", "get_time")) -> dict:
    assert call.type == "function" and call.function.name in names and call.id
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert set(args) == {"city", "unit"} and args["unit"] in ("c", "f")
    else:
        assert args["zone"] in ("utc", "cet")
    return args


def test_required_tool_calls_always_parse(client):
    for seed in range(5):
        out = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
            temperature=1.0, seed=seed, max_tokens=200)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.tool_calls and choice.message.content is None
        for call in choice.message.tool_calls:
            _check_call(call)


def test_a_named_function_gets_its_arguments(client):
    out = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], temperature=1.0, seed=4,
        max_tokens=200, tool_choice={"type": "function", "function": {"name": "get_time"}})
    [call] = out.choices[0].message.tool_calls
    _check_call(call, names=("get_time",))


def test_round_trip_call_then_result_then_answer(client):
    first = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",
        parallel_tool_calls=False, temperature=1.0, seed=1, max_tokens=200)
    [call] = first.choices[0].message.tool_calls
    messages = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER],
                                            tool_choice="none", max_tokens=8)
    choice = answer.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")


def test_streamed_calls_equal_the_whole_call(client):
    args = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                temperature=1.0, seed=7, max_tokens=200)
    whole = client.chat.completions.create(**args).choices[0].message.tool_calls
    names, arguments, reasons = {}, {}, []
    for chunk in client.chat.completions.create(**args, stream=True):
        for choice in chunk.choices:
            reasons.append(choice.finish_reason)
            for delta in choice.delta.tool_calls or []:
                names[delta.index] = names.get(delta.index, "") + (delta.function.name or "")
                arguments[delta.index] = (arguments.get(delta.index, "")
                                          + (delta.function.arguments or ""))
    assert [names[i] for i in sorted(names)] == [c.function.name for c in whole]
    assert [arguments[i] for i in sorted(arguments)] == [c.function.arguments for c in whole]
    assert reasons[-1] == "tool_calls"


def test_auto_reads_the_models_own_format(client):
    """The model is held (by a regex) to write a Hermes call after some text: the parser
    finds it, streamed and not."""
    forced = {"structured_outputs": {"regex": r'[a-z]{2,6} <tool_call>\{"name": '
                                              r'"get_time", "arguments": \{"zone": "utc"\}'
                                              r'\}</tool_call>'}}
    args = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], temperature=1.0, seed=2,
                max_tokens=200, extra_body=forced)
    message = client.chat.completions.create(**args).choices[0].message
    [call] = message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments) == {
        "zone": "utc"}
    assert re.fullmatch(r"[a-z]{2,6}", message.content)
    content, calls = "", []
    for chunk in client.chat.completions.create(**args, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            calls += choice.delta.tool_calls or []
    assert content.strip() == message.content and len(calls) == 1
    assert calls[0].function.arguments == call.function.arguments


ANTHROPIC_WEATHER = {"name": "get_weather", "description": "The weather in a city",
                     "input_schema": WEATHER["function"]["parameters"]}


def test_anthropic_tool_use_round_trip_streamed_and_not(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    args = dict(model=MODEL, max_tokens=200, tools=[ANTHROPIC_WEATHER],
                tool_choice={"type": "any"},
                messages=[{"role": "user", "content": "Weather in Paris?"}])
    message = client.messages.create(**args)
    assert message.stop_reason == "tool_use"
    [use] = [b for b in message.content if b.type == "tool_use"]
    assert use.name == "get_weather" and set(use.input) == {"city", "unit"}
    with client.messages.stream(**args) as stream:
        final = stream.get_final_message()
    [streamed] = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and streamed.name == "get_weather"
    assert set(streamed.input) == {"city", "unit"}
    answer = client.messages.create(
        model=MODEL, max_tokens=8, tools=[ANTHROPIC_WEATHER], messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": use.id,
                                               "name": use.name, "input": use.input}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                          "content": "sunny, 21 C"}]}],
        tool_choice={"type": "none"})
    assert answer.content[0].type == "text"
    assert answer.stop_reason in ("end_turn", "max_tokens")


def test_anthropic_named_tool_and_bad_choice(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    message = client.messages.create(
        model=MODEL, max_tokens=200, tools=[ANTHROPIC_WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": "Weather?"}])
    [use] = [b for b in message.content if b.type == "tool_use"]
    assert use.input["unit"] in ("c", "f")
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model=MODEL, max_tokens=4, tools=[ANTHROPIC_WEATHER],
                               tool_choice={"type": "tool", "name": "nope"},
                               messages=[{"role": "user", "content": "hi"}])
    assert "tool_choice" in str(refused.value)
