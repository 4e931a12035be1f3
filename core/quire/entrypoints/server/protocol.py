"""Request bodies of the OpenAI API -> prompt token ids and ``SamplingParams``.

Every type is checked here, naming the field; range checks are ``SamplingParams``'s (its
``ValueError`` starts with the field's name). Unknown fields are ignored, as vLLM does.
Cheap checks come first: types, the server's :class:`RequestBounds` (prompt bytes, stop
strings, sequences), sampling parameters; the prompt is tokenized (or the chat template
rendered, and its images loaded) only when all of them pass. The parse functions are
blocking: the server runs them off its event loop.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from quire.engine.beam_search import check_beam_params
from quire.entrypoints.server.errors import APIError, bad_request, from_value_error
from quire.entrypoints.server.images import (
    ImageSupport,
    has_images,
    image_prompt,
    openai_part,
)
from quire.entrypoints.server.tool_parsers import ToolParser
from quire.entrypoints.server.tools import ToolRequest, parse_tools, template_messages
from quire.multimodal.inputs import MMItem
from quire.sampling_params import SamplingParams
from quire.structured.params import KINDS as STRUCTURED_KINDS
from quire.structured.params import StructuredOutputsParams

#: Most choices per request (OpenAI's limit); more would only tie up the KV cache.
MAX_N = 128
#: Integers past int64 have no meaning in any field (ids, counts, seeds).
INT64_MAX = 2**63 - 1
_NUMBER = (int, float)


@dataclass(frozen=True)
class RequestBounds:
    """What one request may ask: the server's ``ServerLimits`` settled for its model and
    queue (the app builds it; the defaults live in ``ServerLimits`` only)."""

    #: UTF-8 bytes of all prompt text (prompts, or messages and system) together.
    max_prompt_bytes: int
    max_stop_strings: int
    max_stop_string_chars: int
    #: prompts x n
    max_sequences: int
    #: prompts per request (also bounded by the waiting queue, which each one joins)
    max_prompts: int

    def check_prompt_bytes(self, size: int) -> None:
        if size > self.max_prompt_bytes:
            raise bad_request(f"the prompt is {size} bytes of text, more than this "
                              f"server's limit of {self.max_prompt_bytes} "
                              f"(--max-prompt-bytes)", param="prompt")

    def check_stops(self, stops: list[str], name: str) -> None:
        if len(stops) > self.max_stop_strings:
            raise bad_request(f"{name} has {len(stops)} strings, more than this server's "
                              f"limit of {self.max_stop_strings} (--max-stop-strings)",
                              param=name)
        longest = max((len(s) for s in stops), default=0)
        if longest > self.max_stop_string_chars:
            raise bad_request(f"{name} has a string of {longest} characters, more than "
                              f"this server's limit of {self.max_stop_string_chars} "
                              f"(--max-stop-string-chars)", param=name)

    def check_sequences(self, num_prompts: int, n: int) -> None:
        if num_prompts * n > self.max_sequences:
            raise bad_request(f"{num_prompts} prompt(s) x n={n} is {num_prompts * n} "
                              f"sequences, more than this server's limit of "
                              f"{self.max_sequences} per request "
                              f"(--max-sequences-per-request)", param="n")


@dataclass
class ParsedRequest:
    """What the routes need from a completions or chat body."""

    model: str
    prompt: str | None
    token_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    #: Top alternatives per output token to show, or None for no logprobs.
    top_logprobs: int | None
    #: Completions only: put the prompt in front of the text.
    echo: bool = False
    #: Completions only: the prompts after the first, as (text or None, token ids); the
    #: choices of prompt ``i`` are numbered from ``i * n``.
    more_prompts: list[tuple[str | None, list[int]]] = field(default_factory=list)
    #: The body field that asked for structured outputs (named by a 400 if its grammar
    #: does not compile).
    grammar_param: str | None = None
    #: Chat only: the tools offered and how the answer may call them.
    tools: ToolRequest | None = None
    #: Chat only: the prompt's images (placeholders expanded in ``token_ids``).
    mm: list[MMItem] = field(default_factory=list)

    def prompts(self) -> list[tuple[str | None, list[int]]]:
        """Every prompt of the request, in order."""
        return [(self.prompt, self.token_ids), *self.more_prompts]


def get(body: Mapping[str, Any], name: str, kinds: type | tuple[type, ...],
        default: Any = None, *, nullable: bool = True) -> Any:
    """``body[name]`` if of ``kinds`` (booleans are never numbers), else a 400 naming it."""
    value = body.get(name, default)
    if value is None and nullable:
        return default
    kinds_t = kinds if isinstance(kinds, tuple) else (kinds,)
    is_bool = isinstance(value, bool)
    if not isinstance(value, kinds_t) or (is_bool and bool not in kinds_t):
        wanted = " or ".join(k.__name__ for k in kinds_t)
        raise bad_request(f"{name} must be of type {wanted}, got {type(value).__name__}",
                          param=name)
    if kinds_t == (int,) and not is_bool and abs(value) > INT64_MAX:
        raise bad_request(f"{name} must be an integer in int64's range, got one of "
                          f"{len(str(abs(value)))} digits", param=name)
    return value


def parse_completion(body: Mapping[str, Any], bounds: RequestBounds, *,
                     tokenizer: Any) -> ParsedRequest:
    """A ``/v1/completions`` body. :raises APIError: 400 naming the bad field."""
    prompts = _completion_prompts(body.get("prompt"), bounds)
    logprobs = get(body, "logprobs", int)
    echo = get(body, "echo", bool, False)
    # the echoed prompt carries its logprobs too
    structured, grammar_param = structured_outputs(body)
    params = _sampling_params(body, bounds, default_max_tokens=16, logprobs=logprobs,
                              prompt_logprobs=logprobs if echo else None,
                              structured=structured)
    bounds.check_sequences(len(prompts), params.best_of or params.n)
    (text, ids), *more = [_encode(p, tokenizer) for p in prompts]
    return ParsedRequest(model=_model(body), prompt=text, token_ids=ids, params=params,
                         stream=get(body, "stream", bool, False),
                         include_usage=_include_usage(body), top_logprobs=logprobs,
                         echo=echo, more_prompts=more, grammar_param=grammar_param)


def parse_chat(body: Mapping[str, Any], chat_template: str | None, bounds: RequestBounds,
               tool_parser: ToolParser | None = None, images: ImageSupport | None = None,
               *, tokenizer: Any) -> ParsedRequest:
    """A ``/v1/chat/completions`` body; its images (``images``: how the model takes
    them) are loaded last. :raises APIError: 400 naming the bad field or part."""
    tools = parse_tools(dict(body), tool_parser)
    messages = _messages(body.get("messages"))
    bounds.check_prompt_bytes(messages_bytes(messages))
    want_logprobs = get(body, "logprobs", bool, False)
    top = get(body, "top_logprobs", int)
    if top is not None and not want_logprobs:
        raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
    top_logprobs = (top or 0) if want_logprobs else None
    structured, grammar_param = structured_outputs(body)
    call_grammar = tools.grammar() if tools is not None else None
    if call_grammar is not None:
        if structured is not None:
            raise bad_request(f"tool_choice {tools.choice!r} and {grammar_param} both hold "
                              "the answer to a grammar; give one", param=grammar_param)
        structured, grammar_param = call_grammar, "tools"
    params = _sampling_params(body, bounds, default_max_tokens=None, logprobs=top_logprobs,
                              structured=structured)
    bounds.check_sequences(1, params.best_of or params.n)
    text, ids, mm = chat_prompt(messages, tokenizer, chat_template,
                                tools.tools if tools is not None else None, images)
    return ParsedRequest(model=_model(body), prompt=text, token_ids=ids, params=params,
                         stream=get(body, "stream", bool, False),
                         include_usage=_include_usage(body), top_logprobs=top_logprobs,
                         grammar_param=grammar_param, tools=tools, mm=mm)


def parse_tokenize(body: Mapping[str, Any], chat_template: str | None,
                   bounds: RequestBounds, images: ImageSupport | None = None, *,
                   tokenizer: Any) -> list[int]:
    """A ``/tokenize`` body (``prompt`` or chat ``messages``) -> its token ids (each
    image's placeholder expanded)."""
    if "messages" in body:
        messages = _messages(body.get("messages"))
        bounds.check_prompt_bytes(messages_bytes(messages))
        return chat_prompt(messages, tokenizer, chat_template, None, images)[1]
    prompt = check_text(get(body, "prompt", str, nullable=False), "prompt", "prompt")
    bounds.check_prompt_bytes(_utf8_size(prompt))
    return list(tokenizer.encode(prompt,
                                 add_special_tokens=get(body, "add_special_tokens", bool, True)))


def parse_detokenize(body: Mapping[str, Any], *, tokenizer: Any) -> str:
    """A ``/detokenize`` body -> the text of its token ids (each in the vocabulary)."""
    ids = get(body, "tokens", list, nullable=False)
    size = len(tokenizer)
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < size for t in ids):
        raise bad_request(f"tokens must be a list of token ids, integers in [0, {size})",
                          param="tokens")
    return str(tokenizer.decode(ids))


# -- structured outputs ---------------------------------------------------------
#: vLLM's older names for the fields of ``structured_outputs``.
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


def structured_outputs(body: Mapping[str, Any]
                       ) -> tuple[StructuredOutputsParams | None, str | None]:
    """The grammar a body asks for, and the field that asked: OpenAI's
    ``response_format`` (``text``, ``json_object``, ``json_schema``), vLLM's
    ``structured_outputs`` object, or vLLM's older ``guided_*`` fields; at most one of them.

    :raises APIError: 400 naming the field, for a shape or a mix that cannot be used.
    """
    found: list[tuple[str, dict[str, Any]]] = []
    fmt = get(body, "response_format", dict)
    if fmt is not None:
        kind = get(fmt, "type", str, nullable=False)
        if kind == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif kind == "json_schema":
            spec = get(fmt, "json_schema", dict, nullable=False)
            schema = spec.get("schema")
            if not isinstance(schema, dict):
                raise bad_request("response_format.json_schema.schema must be a JSON schema "
                                  "(an object)", param="response_format")
            found.append(("response_format", {"json": schema}))
        elif kind != "text":
            raise bad_request(f"response_format.type must be 'text', 'json_object' or "
                              f"'json_schema', got {kind!r}", param="response_format")
    so = get(body, "structured_outputs", dict)
    if so is not None:
        found.append(("structured_outputs", dict(so)))
    guided = {field: body[name] for name, field in _GUIDED.items()
              if body.get(name) is not None}
    if guided:
        found.append((next(n for n in _GUIDED if body.get(n) is not None), guided))
    if not found:
        return None, None
    if len(found) > 1:
        names = " and ".join(name for name, _ in found)
        raise bad_request(f"{names} both ask for structured outputs; give one",
                          param=found[1][0])
    param, fields = found[0]
    try:
        unknown = sorted(set(fields) - set(STRUCTURED_KINDS))
        if unknown:
            raise ValueError(f"structured_outputs has no field {unknown[0]!r}; known: "
                             f"{', '.join(STRUCTURED_KINDS)}")
        return StructuredOutputsParams(**fields), param
    except (TypeError, ValueError) as exc:
        raise bad_request(str(exc), param=param) from None


# -- pieces ------------------------------------------------------------------------------
def _model(body: Mapping[str, Any]) -> str:
    return get(body, "model", str, "")


def _include_usage(body: Mapping[str, Any]) -> bool:
    options = get(body, "stream_options", dict, {})
    return bool(get(options, "include_usage", bool, False))


def _sampling_params(body: Mapping[str, Any], bounds: RequestBounds, *,
                     default_max_tokens: int | None, logprobs: int | None,
                     prompt_logprobs: int | None = None,
                     structured: StructuredOutputsParams | None = None) -> SamplingParams:
    n = get(body, "n", int, 1)
    if not 1 <= n <= MAX_N:
        raise bad_request(f"n must be an integer in [1, {MAX_N}], got {n}", param="n")
    max_tokens = default_max_tokens
    for name in ("max_tokens", "max_completion_tokens"):
        value = get(body, name, int)
        if value is not None:
            if value < 1:
                raise bad_request(f"{name} must be an integer >= 1, got {value}", param=name)
            max_tokens = value
    stop = get(body, "stop", (str, list))
    if stop is not None:
        bounds.check_stops([stop] if isinstance(stop, str) else stop, "stop")
    numbers = {name: get(body, name, _NUMBER, default) for name, default in (
        ("temperature", 1.0), ("top_p", 1.0), ("presence_penalty", 0.0),
        ("frequency_penalty", 0.0), ("min_p", 0.0), ("repetition_penalty", 1.0))}
    try:
        params = SamplingParams(
            n=n, max_tokens=max_tokens, stop=stop, seed=get(body, "seed", int),
            top_k=get(body, "top_k", int, 0), min_tokens=get(body, "min_tokens", int, 0),
            ignore_eos=get(body, "ignore_eos", bool, False),
            stop_token_ids=get(body, "stop_token_ids", list),
            include_stop_str_in_output=get(body, "include_stop_str_in_output", bool, False),
            skip_special_tokens=get(body, "skip_special_tokens", bool, True),
            logit_bias=_logit_bias(get(body, "logit_bias", dict)),
            allowed_token_ids=get(body, "allowed_token_ids", list),
            bad_words=get(body, "bad_words", list),
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            structured_outputs=structured, **_beam_fields(body), **numbers)
        if params.use_beam_search:
            check_beam_params(params)
    except ValueError as exc:
        raise from_value_error(exc) from exc
    if params.bad_words:  # tokenized by the engine: bounded as stop strings are
        bounds.check_stops(list(params.bad_words), "bad_words")
    return params


def _beam_fields(body: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's beam search extra parameters (the width is ``best_of``, else ``n``)."""
    best_of = get(body, "best_of", int)
    if best_of is not None and not 1 <= best_of <= MAX_N:
        raise bad_request(f"best_of must be an integer in [1, {MAX_N}], got {best_of}",
                          param="best_of")
    return {"use_beam_search": get(body, "use_beam_search", bool, False),
            "best_of": best_of,
            "length_penalty": get(body, "length_penalty", _NUMBER, 1.0),
            "early_stopping": get(body, "early_stopping", (bool, str), False)}


def _logit_bias(bias: dict[str, Any] | None) -> dict[int, float] | None:
    """OpenAI's keys are token ids written as strings."""
    if bias is None:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}",
                              param="logit_bias") from None
        if isinstance(value, bool) or not isinstance(value, _NUMBER):
            raise bad_request(f"logit_bias[{key}] must be a number", param="logit_bias")
        out[token] = value
    return out


def _completion_prompts(prompt: Any, bounds: RequestBounds) -> list[str | list[int]]:
    """OpenAI's four prompt forms: a string, a list of token ids, or a list of either;
    checked for type, count and size, not yet tokenized."""
    if prompt is None:
        raise bad_request("prompt is required", param="prompt")
    if isinstance(prompt, str) or _is_token_list(prompt):
        prompts = [_one_prompt(prompt, "prompt")]
    elif not isinstance(prompt, list) or not prompt:
        raise bad_request("prompt must be a string, a list of token ids, or a non-empty "
                          "list of either", param="prompt")
    elif len(prompt) > bounds.max_prompts:
        raise bad_request(f"at most {bounds.max_prompts} prompts per request, got "
                          f"{len(prompt)}", param="prompt")
    else:
        prompts = [_one_prompt(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    bounds.check_prompt_bytes(sum(_utf8_size(p) for p in prompts if isinstance(p, str)))
    return prompts


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)


def _one_prompt(prompt: Any, name: str) -> str | list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request(f"{name} must not be empty", param="prompt")
        return check_text(prompt, name, "prompt")
    if _is_token_list(prompt):
        return list(prompt)
    raise bad_request(f"{name} must be a non-empty string or a non-empty list of token ids",
                      param="prompt")


def _encode(prompt: str | list[int], tokenizer: Any) -> tuple[str | None, list[int]]:
    if isinstance(prompt, str):
        return prompt, list(tokenizer.encode(prompt))
    return None, prompt


def _utf8_size(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def messages_bytes(messages: list[dict[str, Any]]) -> int:
    """UTF-8 bytes of the messages' roles and text (images count against the body's
    size and the media policy's, not the prompt's)."""
    return sum(_utf8_size(m["role"]) + content_bytes(m["content"]) for m in messages)


def content_bytes(content: str | list[dict[str, Any]]) -> int:
    """UTF-8 bytes of a message's text, whether a string or parts."""
    if isinstance(content, str):
        return _utf8_size(content)
    return sum(_utf8_size(p["text"]) for p in content if p["type"] == "text")


def check_text(text: str, name: str, param: str) -> str:
    """``text`` if it is valid Unicode; JSON may carry lone surrogates (``"\\ud800"``),
    which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad_request(f"{name} is not valid Unicode text: {exc.reason} at position "
                          f"{exc.start}", param=param) from None
    return text


def _messages(messages: Any) -> list[dict[str, Any]]:
    """Chat messages as the template takes them: role and content (text, or text and
    image parts), and for tool calling an assistant's ``tool_calls`` and a tool
    message's ``tool_call_id``."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", param="messages")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a string role",
                              param="messages")
        role = check_text(msg["role"], f"messages[{i}].role", "messages")
        content = _content(msg.get("content"), i)
        entry: dict[str, Any] = {"role": role, "content": content}
        if msg.get("tool_calls") is not None:
            entry["tool_calls"] = _tool_calls(msg["tool_calls"], i)
        for key in ("tool_call_id", "name"):
            if msg.get(key) is not None:
                entry[key] = check_text(get(msg, key, str), f"messages[{i}].{key}",
                                        "messages")
        out.append(entry)
    return out


def _tool_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    shape = (f"messages[{i}].tool_calls must be a list of {{id, type: function, "
             "function: {name, arguments}}}")
    if not isinstance(calls, list):
        raise bad_request(shape, param="messages")
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)
                and isinstance(fn.get("arguments", "{}"), (str, dict))):
            raise bad_request(shape, param="messages")
        out.append({"id": str(call.get("id", "")), "type": "function",
                    "function": {"name": fn["name"], "arguments": fn.get("arguments", "{}")}})
    return out


def _content(content: Any, i: int) -> str | list[dict[str, Any]]:
    """A message's text, or, when it holds images, its text and image parts in order."""
    field = f"messages[{i}].content"
    if content is None or isinstance(content, str):
        return check_text(content or "", field, "messages")
    if not isinstance(content, list):
        raise bad_request(f"{field} must be a string or a list of text and image_url parts",
                          param="messages")
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": check_text(part["text"], field,
                                                             "messages")})
        elif kind == "image_url":
            parts.append(openai_part(part, f"{field}[{j}]"))
        else:
            raise bad_request(f"{field} parts must be text or image_url parts; "
                              f"{field}[{j}] is not", param="messages")
    if any(p["type"] == "image_url" for p in parts):
        return parts
    return "".join(p["text"] for p in parts)


def chat_prompt(messages: list[dict[str, Any]], tokenizer: Any, chat_template: str | None,
                tools: list[dict[str, Any]] | None = None,
                images: ImageSupport | None = None, suffix: str = ""
                ) -> tuple[str, list[int], list[MMItem]]:
    """The prompt of ``messages`` (``suffix`` after the rendered template: a prefill):
    its text, token ids and images. Blocking: images are fetched and preprocessed here.
    :raises APIError: 400 naming what cannot be used."""
    def render(ready: list[dict[str, Any]]) -> str:
        return render_chat(ready, tokenizer, chat_template, tools) + suffix

    if has_images(messages):
        return image_prompt(messages, chat_template or getattr(tokenizer, "chat_template",
                                                               None), render, images)
    text = render(messages)
    return text, list(tokenizer.encode(text, add_special_tokens=False)), []


def render_chat(messages: list[dict[str, Any]], tokenizer: Any,
                chat_template: str | None, tools: list[dict[str, Any]] | None = None) -> str:
    """The prompt text of ``messages`` (with the generation prompt, and ``tools`` for
    templates that describe them), by ``chat_template`` or the tokenizer's own.
    :raises APIError: 400 when there is no template or it fails."""
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template; start the server with "
                            "--chat-template FILE (a Jinja template), or use "
                            "/v1/completions", param="messages")
    try:
        return tokenizer.apply_chat_template(template_messages(messages),
                                             chat_template=chat_template, tools=tools,
                                             tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # a Jinja error caused by the messages
        raise bad_request(f"the chat template failed on these messages: {exc}",
                          param="messages") from exc
