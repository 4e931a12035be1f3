"""OpenAI tool calling on ``/v1/chat/completions``: the request's ``tools`` and
``tool_choice``, the grammar that makes a required or named call always parse, and the
calls an answer carries.

- ``tool_choice: "none"``: the tools go to the chat template only; the answer is text.
- ``"auto"`` (the default with tools): the model decides; its calls are read from its own
  format by the ``--tool-call-parser`` (:mod:`.tool_parsers`). Without one, a 400.
- ``"required"``: the answer is a JSON list of calls, ``[{"name", "parameters"}]``, held
  to the tools' schemas by the grammar engine (one call unless ``parallel_tool_calls``).
- ``{"type": "function", "function": {"name": N}}``: the answer is N's arguments, held
  to its ``parameters`` schema.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

from quire.entrypoints.server.errors import APIError, bad_request
from quire.entrypoints.server.reasoning_parsers import ReasoningParser
from quire.entrypoints.server.tool_parsers import ToolCall, ToolParser
from quire.structured.params import StructuredOutputsParams

#: A function without ``parameters`` takes any JSON object.
_ANY_OBJECT: dict[str, Any] = {"type": "object"}
#: Calls are written compactly (llguidance's option): arguments are read by programs,
#: and whitespace between tokens is where a small model wanders off.
_COMPACT = {"x-guidance": {"whitespace_flexible": False}}


@dataclass(frozen=True)
class ToolRequest:
    #: The tools as the chat template takes them (OpenAI's shape).
    tools: list[dict[str, Any]]
    #: "none", "auto", "required", or the name of the function to call.
    choice: str
    named: bool
    parallel: bool

    def grammar(self) -> StructuredOutputsParams | None:
        """What holds a required or named call to the tools' schemas, or None."""
        if self.named:
            fn = next(t["function"] for t in self.tools if t["function"]["name"] == self.choice)
            return StructuredOutputsParams(json={**_COMPACT,
                                                 **(fn.get("parameters") or _ANY_OBJECT)})
        if self.choice != "required":
            return None
        calls = [{"type": "object", "properties": {
            "name": {"const": t["function"]["name"]},
            "parameters": t["function"].get("parameters") or _ANY_OBJECT},
            "required": ["name", "parameters"], "additionalProperties": False}
            for t in self.tools]
        array: dict[str, Any] = {"type": "array", "minItems": 1,
                                 "items": {"anyOf": calls}, **_COMPACT}
        if not self.parallel:
            array["maxItems"] = 1
        return StructuredOutputsParams(json=array)

    def calls(self, text: str, parser: ToolParser | None) -> tuple[str | None, list[ToolCall]]:
        """The answer's (content, calls)."""
        if self.named:
            return None, [ToolCall(self.choice, text)]
        if self.choice == "required":
            try:
                items = json.loads(text)
                return None, [ToolCall(i["name"], json.dumps(i["parameters"],
                                                             ensure_ascii=False))
                              for i in items]
            except (ValueError, KeyError, TypeError):  # cut by max_tokens
                return text, []
        if self.choice == "auto" and parser is not None:
            content, calls = parser.parse(text)
            return (content or None) if calls else text, calls
        return text, []


def parse_tools(body: dict[str, Any], parser: ToolParser | None) -> ToolRequest | None:
    """The tool request of a chat body, checked; None without tools.

    :raises APIError: 400 naming the field (``tools``, ``tool_choice``).
    """
    for old in ("functions", "function_call"):
        if body.get(old) is not None:
            raise APIError(400, f"{old} is OpenAI's deprecated form; use tools and "
                           "tool_choice", param=old, code="unsupported_parameter")
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if not tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", param="tool_choice")
        return None
    if not isinstance(tools, list):
        raise bad_request("tools must be a list of {type: function, function: {...}}",
                          param="tools")
    names = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and tool.get("type") == "function"
                and isinstance(fn, dict) and isinstance(fn.get("name"), str) and fn["name"]):
            raise bad_request(f"tools[{i}] must be {{type: function, function: {{name, "
                              "description, parameters}}}}", param="tools")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema",
                              param="tools")
        names.append(fn["name"])
    named = False
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or name not in names:
            raise bad_request(f"tool_choice names a function not in tools: {name!r}; "
                              f"tools: {', '.join(names)}", param="tool_choice")
        choice, named = name, True
    elif choice not in ("none", "auto", "required"):
        raise bad_request("tool_choice must be 'none', 'auto', 'required' or "
                          "{type: function, function: {name}}", param="tool_choice")
    if choice == "auto" and parser is None:
        raise bad_request("tool_choice 'auto' needs the server started with "
                          "--tool-call-parser; 'required' or a named function work "
                          "without one", param="tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad_request("parallel_tool_calls must be true or false",
                          param="parallel_tool_calls")
    return ToolRequest(tools=tools, choice=choice, named=named, parallel=parallel)


def split_answer(text: str, final: bool, tools: ToolRequest | None,
                 tool_parser: ToolParser | None, reasoning: ReasoningParser | None
                 ) -> tuple[str | None, str | None, list[ToolCall]]:
    """A chat answer's (thinking, content, calls), for both APIs' shapers.

    While not ``final`` (a stream), only what can be shown already: thinking less a tail
    that may be a tag, content before anything that may begin a call (none at all for a
    required or named call), no calls. ``final``: content is None when calls took the
    whole answer.
    """
    thinking, answer = reasoning.split(text, final) if reasoning is not None else (None, text)
    if tools is None:
        return thinking, answer, []
    if final:
        content, calls = tools.calls(answer, tool_parser)
        return thinking, content, calls
    if tools.choice == "auto" and tool_parser is not None:
        return thinking, tool_parser.content_before_call(answer), []
    return thinking, "", []  # a required or named call is the whole answer


def openai_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """OpenAI's ``tool_calls`` for an answer."""
    return [{"id": f"call_{secrets.token_hex(12)}", "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates take them: an assistant's ``tool_calls`` with their
    arguments as objects (templates write them with ``tojson``)."""
    out = []
    for msg in messages:
        calls = msg.get("tool_calls")
        if calls:
            msg = {**msg, "tool_calls": [
                {**c, "function": {**c["function"],
                                   "arguments": _as_object(c["function"].get("arguments"))}}
                for c in calls]}
        out.append(msg)
    return out


def _as_object(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments
