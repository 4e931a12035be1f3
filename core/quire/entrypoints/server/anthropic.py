"""Anthropic's Messages API (``POST /v1/messages``) over the same engine as the OpenAI
routes: request bodies -> :class:`ParsedRequest`, ``RequestOutput`` -> Message objects and
stream events, and :class:`APIError` -> Anthropic's error body.

Types are checked with :func:`quire.entrypoints.server.protocol.get` (a 400 naming the field), ranges
by ``SamplingParams``. Unknown fields are ignored, as on the OpenAI routes.

Stream events, in the order Anthropic documents them (each ``event: TYPE`` + ``data:``)::

    message_start -> content_block_start -> ping -> content_block_delta* ->
    content_block_stop -> message_delta (stop_reason, usage) -> message_stop
"""

from __future__ import annotations

import hmac
import json
import secrets
from collections.abc import AsyncIterator, Mapping
from typing import Any

from starlette.responses import JSONResponse

from quire.entrypoints.server.async_engine import EngineStopped, RequestStream
from quire.entrypoints.server.errors import APIError, bad_request, from_value_error
from quire.entrypoints.server.images import ImageSupport, anthropic_block
from quire.entrypoints.server.protocol import (
    ParsedRequest,
    RequestBounds,
    chat_prompt,
    check_text,
    content_bytes,
    get,
)
from quire.entrypoints.server.reasoning_parsers import ReasoningParser
from quire.entrypoints.server.tool_parsers import ToolParser
from quire.entrypoints.server.tools import ToolRequest, parse_tools, split_answer
from quire.outputs import CompletionOutput, RequestOutput
from quire.sampling_params import SamplingParams

_NUMBER = (int, float)
_ROLES = ("user", "assistant")
#: Anthropic's error type per HTTP status; see :func:`_error_type` for the rest.
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large"}
#: Errors the engine raises into a request's stream when it fails the request midway.
_ENGINE_FAILURES = (ValueError, RuntimeError, EngineStopped)


# -- requests ----------------------------------------------------------------------------
def check_api_key(headers: Mapping[str, str], api_key: str | None) -> None:
    """Anthropic clients send the key as ``x-api-key``; ``Authorization: Bearer`` (what
    the OpenAI routes take) is accepted too. :raises APIError: 401."""
    if api_key is None:
        return
    token = headers.get("x-api-key")
    if token is None:
        auth = headers.get("authorization", "")
        token = auth[7:] if auth.lower().startswith("bearer ") else ""
    if not hmac.compare_digest(token.encode(), api_key.encode()):
        raise APIError(401, "invalid or missing API key (x-api-key: ... or "
                            "Authorization: Bearer ...)", type="authentication_error")


def parse_messages(body: Mapping[str, Any], chat_template: str | None,
                   bounds: RequestBounds, tool_parser: ToolParser | None = None,
                   images: ImageSupport | None = None, *, tokenizer: Any) -> ParsedRequest:
    """A ``/v1/messages`` body; blocking (it renders and tokenizes the prompt and loads
    its images, as ``images`` says the model takes them), checked cheapest first.
    :raises APIError: 400 naming the bad field or block."""
    model = _required(body, "model", str)
    max_tokens = _required(body, "max_tokens", int)
    tools = _tools(body, tool_parser)
    chat = _turns(body.get("messages"))
    system = _system(body.get("system"))
    if system is not None:
        chat.insert(0, {"role": "system", "content": system})
    bounds.check_prompt_bytes(sum(content_bytes(t["content"]) for t in chat))
    params = _sampling_params(body, max_tokens, bounds)
    if tools is not None:
        params.structured_outputs = tools.grammar()
    # A last assistant turn is a prefill: the answer continues it rather than following it.
    prefill = ""
    if chat[-1]["role"] == "assistant" and not chat[-1].get("tool_calls"):
        prefill = chat.pop()["content"]
    text, ids, mm = chat_prompt(chat, tokenizer, chat_template,
                                tools.tools if tools is not None else None, images,
                                suffix=prefill)
    return ParsedRequest(model=model, prompt=text, token_ids=ids, mm=mm,
                         params=params, stream=get(body, "stream", bool, False),
                         include_usage=False, top_logprobs=None, tools=tools,
                         grammar_param="tools" if params.structured_outputs else None)


def _tools(body: Mapping[str, Any], parser: ToolParser | None) -> ToolRequest | None:
    """Anthropic's ``tools`` (``name``, ``description``, ``input_schema``) and
    ``tool_choice`` (``auto``, ``any``, ``tool`` + ``name``, ``none``;
    ``disable_parallel_tool_use``), as the OpenAI route's tool request."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if not tools:
        if choice is not None and not (isinstance(choice, Mapping)
                                       and choice.get("type") in ("none", "auto")):
            raise bad_request("tool_choice needs tools", param="tool_choice")
        return None
    if not isinstance(tools, list):
        raise bad_request("tools must be a list of {name, description, input_schema}",
                          param="tools")
    functions = []
    for i, tool in enumerate(tools):
        if not (isinstance(tool, Mapping) and isinstance(tool.get("name"), str)
                and isinstance(tool.get("input_schema", {}), Mapping)):
            raise bad_request(f"tools[{i}] must be {{name, description, input_schema}}",
                              param=f"tools[{i}]")
        fn = {"name": tool["name"], "parameters": dict(tool.get("input_schema") or {})}
        if isinstance(tool.get("description"), str):
            fn["description"] = tool["description"]
        functions.append({"type": "function", "function": fn})
    choice = choice if choice is not None else {"type": "auto"}
    if not isinstance(choice, Mapping):
        raise bad_request("tool_choice must be {type: auto|any|tool|none}",
                          param="tool_choice")
    kind = choice.get("type")
    openai_choice: Any = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if kind == "tool":
        openai_choice = {"type": "function", "function": {"name": choice.get("name")}}
    if openai_choice is None:
        raise bad_request(f"tool_choice.type must be auto, any, tool or none, got {kind!r}",
                          param="tool_choice")
    parallel = not choice.get("disable_parallel_tool_use", False)
    return parse_tools({"tools": functions, "tool_choice": openai_choice,
                        "parallel_tool_calls": parallel}, parser)


def _required(body: Mapping[str, Any], name: str, kind: type) -> Any:
    if body.get(name) is None:
        raise bad_request(f"{name} is required", param=name)
    return get(body, name, kind)


def _turns(messages: Any) -> list[dict[str, Any]]:
    """``messages`` as chat-template turns; consecutive turns of one role become one, as
    Anthropic combines them (templates often insist that roles alternate). An
    assistant's ``tool_use`` blocks become its ``tool_calls``, a user's ``tool_result``
    blocks become ``tool`` messages (as the OpenAI route takes them). A user's ``image``
    blocks make its content a list of parts."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", param="messages")
    turns: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        role = msg.get("role") if isinstance(msg, dict) else None
        if role not in _ROLES:
            raise bad_request(f"messages[{i}] must be an object with role 'user' or "
                              f"'assistant', got role {role!r}",
                              param=f"messages[{i}].role")
        field = f"messages[{i}].content"
        content, calls, results = _blocks(msg.get("content"), field, role)
        for tool_use_id, result in results:
            turns.append({"role": "tool", "tool_call_id": tool_use_id, "content": result})
        if results and not content:
            continue
        if turns and turns[-1]["role"] == role and not calls \
                and not turns[-1].get("tool_calls"):
            turns[-1]["content"] = _joined(turns[-1]["content"], content)
            continue
        turn: dict[str, Any] = {"role": role, "content": content}
        if calls:
            turn["tool_calls"] = calls
        turns.append(turn)
    return turns


def _joined(first: str | list[dict[str, Any]], second: str | list[dict[str, Any]]
            ) -> str | list[dict[str, Any]]:
    """Two turns' content as one, a blank line apart."""
    if isinstance(first, str) and isinstance(second, str):
        return first + "\n\n" + second
    return [*_as_parts(first), {"type": "text", "text": "\n\n"}, *_as_parts(second)]


def _as_parts(content: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"type": "text", "text": content}] if isinstance(content, str) else content


def _blocks(content: Any, field: str, role: str
            ) -> tuple[str | list[dict[str, Any]], list[dict[str, Any]], list[tuple[str, str]]]:
    """(content: its text, or its text and image parts; tool calls; tool results) of a
    message's content."""
    if isinstance(content, str):
        return check_text(content, field, field), [], []
    if not isinstance(content, list):
        raise bad_request(f"{field} must be a string or a list of content blocks",
                          param=field)
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    results: list[tuple[str, str]] = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        where = f"{field}[{j}]"
        if kind == "text" and isinstance(block.get("text"), str):
            parts.append({"type": "text", "text": check_text(block["text"], where, where)})
        elif kind == "image" and role == "user":
            parts.append(anthropic_block(block, where))
        elif kind == "tool_use" and role == "assistant" and isinstance(block.get("name"), str):
            calls.append({"id": str(block.get("id", "")), "type": "function",
                          "function": {"name": block["name"],
                                       "arguments": json.dumps(block.get("input") or {})}})
        elif kind == "tool_result" and role == "user":
            results.append((str(block.get("tool_use_id", "")),
                            _text(block.get("content", ""), where + ".content")))
        else:
            raise bad_request(f"{where} must be a text block, an assistant's tool_use or a "
                              f"user's image or tool_result; block type {kind!r} is not "
                              f"supported", param=where)
    if any(p["type"] == "image" for p in parts):
        return parts, calls, results
    return "".join(p["text"] for p in parts), calls, results


def _system(system: Any) -> str | None:
    return None if system is None else _text(system, "system")


def _text(content: Any, field: str) -> str:
    """A string, or a list of text blocks joined; other block types are refused."""
    if isinstance(content, str):
        return check_text(content, field, field)
    if not isinstance(content, list):
        raise bad_request(f"{field} must be a string or a list of text blocks",
                          param=field)
    parts = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text" or not isinstance(block.get("text"), str):
            raise bad_request(f"{field}[{j}] must be a text block {{\"type\": \"text\", "
                              f"\"text\": ...}}; block type {kind!r} is not supported",
                              param=f"{field}[{j}]")
        parts.append(block["text"])
    return check_text("".join(parts), field, field)


def _sampling_params(body: Mapping[str, Any], max_tokens: int,
                     bounds: RequestBounds) -> SamplingParams:
    temperature = get(body, "temperature", _NUMBER, 1.0)
    if not 0 <= temperature <= 1:  # Anthropic's range; also refuses NaN
        raise bad_request(f"temperature must be in [0, 1], got {temperature}",
                          param="temperature")
    stops = get(body, "stop_sequences", list, [])
    if not all(isinstance(s, str) and s for s in stops):
        raise bad_request("stop_sequences must be a list of non-empty strings",
                          param="stop_sequences")
    bounds.check_stops(stops, "stop_sequences")
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=temperature,
                              top_p=get(body, "top_p", _NUMBER, 1.0),
                              top_k=get(body, "top_k", int, 0), stop=stops)
    except ValueError as exc:
        raise from_value_error(exc) from exc


# -- answers -----------------------------------------------------------------------------
def stop_reason(c: CompletionOutput, max_tokens: int | None,
                num_tokens: int | None = None) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` for the finished output ``c``
    of ``num_tokens`` tokens (``len(c.token_ids)`` unless ``c`` is a delta)."""
    if c.finish_reason == "length":
        num_tokens = len(c.token_ids) if num_tokens is None else num_tokens
        hit_max = max_tokens is not None and num_tokens >= max_tokens
        return ("max_tokens" if hit_max else "model_context_window_exceeded"), None
    if isinstance(c.stop_reason, str):  # a stop string; a token id is a kind of EOS
        return "stop_sequence", c.stop_reason
    return "end_turn", None


class MessageShaper:
    """Builds one request's Message, whole or as stream events (dicts whose ``type`` is
    the event name); for streams it counts the tokens sent.

    A stream's content blocks, in order: ``thinking`` (with a reasoning parser, when the
    model thought), ``text``, then one ``tool_use`` per call. Thinking and text go out as
    they come, less a tail that may still turn into a tag or a call; each call's input
    goes out whole as one ``input_json_delta`` when the answer ends. Without a reasoning
    parser the text block opens at once, as Anthropic's own streams do.
    """

    def __init__(self, *, model: str, request_id: str, input_tokens: int,
                 max_tokens: int | None, tools: ToolRequest | None = None,
                 tool_parser: ToolParser | None = None,
                 reasoning: ReasoningParser | None = None) -> None:
        """:param tools: the request's tools: answers then carry ``tool_use`` blocks.
        :param reasoning: splits the thinking into a ``thinking`` block."""
        self.tools = tools if tools is not None and tools.choice != "none" else None
        self.tool_parser = tool_parser
        self.reasoning = reasoning
        self.model = model
        self.id = "msg_" + request_id
        self.input_tokens = input_tokens
        self.max_tokens = max_tokens
        #: Tokens streamed so far.
        self.output_tokens = 0
        self._text = ""  # the stream's text so far
        self._sent = {"thinking": 0, "text": 0}  # characters of each block sent
        self._open: tuple[int, str] | None = None  # the open block: index, kind
        self._next = 0  # the next block's index

    def _parts(self, text: str, final: bool) -> tuple[str, str, list[dict[str, Any]]]:
        """(thinking, text, tool_use blocks) of the answer so far; while not ``final``,
        only what can be shown already."""
        thinking, content, calls = split_answer(text, final, self.tools, self.tool_parser,
                                                self.reasoning)
        uses = [{"type": "tool_use", "id": "toolu_" + secrets.token_hex(12),
                 "name": c.name, "input": json.loads(c.arguments)} for c in calls]
        return thinking or "", content or "", uses

    def _message(self, c: CompletionOutput | None) -> dict[str, Any]:
        """The Message for the finished output ``c``, or the empty one a stream opens."""
        content: list[dict[str, Any]] = []
        reason, sequence, output_tokens = None, None, 0
        if c is not None:
            reason, sequence = stop_reason(c, self.max_tokens)
            output_tokens = len(c.token_ids)
            thinking, text, uses = self._parts(c.text, final=True)
            if thinking:
                content.append({"type": "thinking", "thinking": thinking, "signature": ""})
            if text or not uses:
                content.append({"type": "text", "text": text})
            content += uses
            if uses and reason == "end_turn":
                reason = "tool_use"
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": reason, "stop_sequence": sequence,
                "usage": {"input_tokens": self.input_tokens,
                          "output_tokens": output_tokens}}

    def whole(self, out: RequestOutput) -> dict[str, Any]:
        return self._message(out.outputs[0])

    def start(self) -> list[dict[str, Any]]:
        """The events before any text: known as soon as the request is accepted."""
        events: list[dict[str, Any]] = [{"type": "message_start",
                                         "message": self._message(None)}]
        if self.reasoning is None:
            events += self._block("text")
        return events + [{"type": "ping"}]

    def _block(self, kind: str) -> list[dict[str, Any]]:
        """Events that make ``kind`` the open block (closing the one before)."""
        if self._open is not None and self._open[1] == kind:
            return []
        events = self._close()
        self._open = (self._next, kind)
        self._next += 1
        empty = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" \
            else {"type": "text", "text": ""}
        return events + [{"type": "content_block_start", "index": self._open[0],
                          "content_block": empty}]

    def _close(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        index, self._open = self._open[0], None
        return [{"type": "content_block_stop", "index": index}]

    def _news(self, thinking: str, text: str) -> list[dict[str, Any]]:
        """Deltas for what ``thinking`` and ``text`` add to what was sent."""
        events: list[dict[str, Any]] = []
        for kind, value, delta in (("thinking", thinking, "thinking_delta"),
                                   ("text", text, "text_delta")):
            if len(value) > self._sent[kind]:
                events += self._block(kind)
                events.append({"type": "content_block_delta", "index": self._open[0],
                               "delta": {"type": delta,
                                         kind: value[self._sent[kind]:]}})
                self._sent[kind] = len(value)
        return events

    def deltas(self, out: RequestOutput) -> list[dict[str, Any]]:
        """The events for ``out``, a ``DELTA`` output (the text and tokens of one step)."""
        if not out.outputs:
            return []
        c = out.outputs[0]
        self.output_tokens += len(c.token_ids)
        self._text += c.text
        if c.finish_reason is not None:
            return []  # the last text goes out with the closing events
        thinking, text, _ = self._parts(self._text, final=False)
        return self._news(thinking, text)

    def finish(self, out: RequestOutput) -> list[dict[str, Any]]:
        """The closing events; ``out`` is the last ``DELTA`` output."""
        reason, sequence = stop_reason(out.outputs[0], self.max_tokens,
                                       self.output_tokens)
        thinking, text, uses = self._parts(self._text, final=True)
        events = self._news(thinking, text)
        if self._next == 0:  # nothing at all: an empty text block
            events += self._block("text")
        events += self._close()
        for use in uses:
            index = self._next
            self._next += 1
            events += [{"type": "content_block_start", "index": index,
                        "content_block": {**use, "input": {}}},
                       {"type": "content_block_delta", "index": index,
                        "delta": {"type": "input_json_delta",
                                  "partial_json": json.dumps(use["input"])}},
                       {"type": "content_block_stop", "index": index}]
        if uses and reason == "end_turn":
            reason = "tool_use"
        return events + [{"type": "message_delta",
                          "delta": {"stop_reason": reason, "stop_sequence": sequence},
                          "usage": {"output_tokens": self.output_tokens}},
                         {"type": "message_stop"}]

    def usage(self) -> dict[str, int]:
        """The streamed request's token counts, in OpenAI's shape (for the access log)."""
        return {"prompt_tokens": self.input_tokens, "completion_tokens": self.output_tokens,
                "total_tokens": self.input_tokens + self.output_tokens}


async def events(stream: RequestStream, shaper: MessageShaper,
                 state: Any) -> AsyncIterator[str]:
    """The SSE body; leaving early (client gone) aborts the request. Leaves the OpenAI
    ``usage`` dict in ``state`` (the request's) for the access log."""
    final = None
    try:
        for event in shaper.start():
            yield _sse(event)
        async for out in stream:
            final = out
            for event in shaper.deltas(out):
                yield _sse(event)
    except _ENGINE_FAILURES as exc:  # after the 200: only an error event can say so
        failed = APIError(500, f"request {stream.request_id} failed: {exc}",
                          type="server_error")
        yield _sse(error_body(failed))
    finally:
        stream.abort()
    state.usage = shaper.usage()
    if final is not None and final.finished:
        for event in shaper.finish(final):
            yield _sse(event)


def _sse(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


# -- errors ------------------------------------------------------------------------------
def _error_type(exc: APIError) -> str:
    if exc.code == "overloaded":
        return "overloaded_error"
    if exc.status >= 500:
        return "api_error"
    return _ERROR_TYPES.get(exc.status, "invalid_request_error")


def error_body(exc: APIError) -> dict[str, Any]:
    """``{"type": "error", "error": {"type", "message"}}``; the message names the field."""
    return {"type": "error", "error": {"type": _error_type(exc), "message": exc.message}}


def error_response(exc: APIError) -> JSONResponse:
    """``exc`` in Anthropic's shape, with its status and headers (``Retry-After``)."""
    return JSONResponse(error_body(exc), status_code=exc.status, headers=exc.headers)
