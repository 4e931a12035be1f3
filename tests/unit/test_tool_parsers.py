"""Tool-call parsers on recorded answers of each format, well formed and not: a malformed
call comes back as content, never as an exception; and the request side's checks."""

from __future__ import annotations

import json

import pytest
from quire.entrypoints.server.errors import APIError
from quire.entrypoints.server.tool_parsers import (
    PARSERS,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    ToolCall,
)
from quire.entrypoints.server.tools import parse_tools

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.mark.parametrize("parser, text, content, calls", [
    (HermesParser(), 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
     '{"city": "Paris"}}\n</tool_call>', "Let me check.",
     [ToolCall("get_weather", '{"city": "Paris"}')]),
    (HermesParser(), '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>'
     '{"name": "b", "arguments": {"x": 1}}</tool_call>', "",
     [ToolCall("a", "{}"), ToolCall("b", '{"x": 1}')]),
    (Llama3JsonParser(), '{"name": "get_weather", "parameters": {"city": "Oslo"}}', "",
     [ToolCall("get_weather", '{"city": "Oslo"}')]),
    (Llama3JsonParser(), '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", '
     '"parameters": {"y": true}}', "", [ToolCall("a", "{}"), ToolCall("b", '{"y": true}')]),
    (MistralParser(), 'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": '
     '{"city": "Rome"}}]', "Sure.", [ToolCall("get_weather", '{"city": "Rome"}')]),
    (MistralParser(), '[TOOL_CALLS] {"name": "f", "arguments": "{\\"k\\": 2}"}', "",
     [ToolCall("f", '{"k": 2}')]),
])
def test_recorded_calls_are_read(parser, text, content, calls):
    assert parser.parse(text) == (content, calls)


@pytest.mark.parametrize("parser, text", [
    (HermesParser(), "no call at all"),
    (HermesParser(), '<tool_call>{"name": "get_weather", "arguments": {"city": '),  # cut
    (HermesParser(), "<tool_call>not json</tool_call>"),
    (HermesParser(), '<tool_call>{"arguments": {}}</tool_call>'),  # no name
    (Llama3JsonParser(), "The weather is fine."),
    (Llama3JsonParser(), '{"name": "f", "parameters": [1, 2]}'),
    (Llama3JsonParser(), '{"name": "f", "parameters": {}} and then prose'),
    (MistralParser(), "[TOOL_CALLS] [{broken"),
    (MistralParser(), "[TOOL_CALLS] []"),
])
def test_malformed_calls_come_back_as_content(parser, text):
    assert parser.parse(text) == (text, [])


def test_stream_content_stops_before_a_possible_marker():
    hermes = HermesParser()
    assert hermes.content_before_call("Hello <tool") == "Hello "
    assert hermes.content_before_call("Hello <tool_call>{") == "Hello "
    assert hermes.content_before_call("Hello there") == "Hello there"
    assert Llama3JsonParser().content_before_call('{"na') == ""
    assert set(PARSERS) == {"hermes", "llama3_json", "mistral"}


def test_required_and_named_choices_become_grammars():
    required = parse_tools({"tools": [WEATHER], "tool_choice": "required",
                            "parallel_tool_calls": False}, None)
    schema = required.grammar().json
    assert schema["maxItems"] == 1
    assert schema["items"]["anyOf"][0]["properties"]["name"] == {"const": "get_weather"}
    content, calls = required.calls(json.dumps([{"name": "get_weather",
                                                 "parameters": {"city": "Lima"}}]), None)
    assert content is None and calls == [ToolCall("get_weather", '{"city": "Lima"}')]
    named = parse_tools({"tools": [WEATHER], "tool_choice": {
        "type": "function", "function": {"name": "get_weather"}}}, None)
    assert named.grammar().json == {**WEATHER["function"]["parameters"],
                                   "x-guidance": {"whitespace_flexible": False}}
    assert named.calls('{"city": "Kyiv"}', None) == \
        (None, [ToolCall("get_weather", '{"city": "Kyiv"}')])


@pytest.mark.parametrize("body, param", [
    ({"tools": "get_weather"}, "tools"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function",
                                          "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER]}, "tool_choice"),  # auto without a parser
    ({"tool_choice": "required"}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": "yes"},
     "parallel_tool_calls"),
])
def test_bad_tool_requests_are_400s_naming_the_field(body, param):
    with pytest.raises(APIError) as refused:
        parse_tools(body, None)
    assert refused.value.status == 400 and refused.value.param == param
