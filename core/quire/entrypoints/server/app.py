"""The Starlette app: OpenAI-compatible routes over one :class:`AsyncEngine` per model
served, each request going to the model (or LoRA adapter) its ``model`` field names.

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``,
``POST /v1/embeddings`` (an embedding model answers only this one of the four),
``POST /tokenize``, ``POST /detokenize``, ``GET /health``, ``GET /version``, and Anthropic's
``POST /v1/messages``. Every error is answered in OpenAI's shape (see
:mod:`quire.entrypoints.server.errors`), except on ``/v1/messages``, which answers in Anthropic's (see
:mod:`quire.entrypoints.server.anthropic`); a fault of ours is a 500 in the same shapes, and the
connection stays usable (:class:`~quire.entrypoints.server.errors.ErrorShield`). ``GET /metrics``
answers Prometheus text (see :mod:`quire.entrypoints.server.metrics`), and ``GET /dashboard``
a page that charts it (see :mod:`quire.entrypoints.server.dashboard`).

A request is checked cheapest first: the API key, the body's size and arrival time, the
model name, then (on a worker thread, :mod:`quire.entrypoints.server.tokenizer_pool`) JSON, types,
limits and sampling parameters, and only then the chat template, tokenization and a
chat's images (fetched, decoded and preprocessed on that thread too, see
:mod:`quire.entrypoints.server.images`). The app's lifespan starts the engine thread (if
not started) and shuts it down.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from quire import __version__
from quire.engine.messages import ThinkingTokens
from quire.entrypoints.server import anthropic
from quire.entrypoints.server.access_log import AccessLog
from quire.entrypoints.server.async_engine import (
    AsyncEngine,
    EngineStopped,
    Overloaded,
    RequestStream,
)
from quire.entrypoints.server.dashboard import Dashboard
from quire.entrypoints.server.embeddings import embedding_response, parse_embedding
from quire.entrypoints.server.errors import (
    APIError,
    ErrorShield,
    bad_request,
    from_value_error,
)
from quire.entrypoints.server.event_stream import EventStream
from quire.entrypoints.server.images import ImageSupport
from quire.entrypoints.server.limits import ServerLimits
from quire.entrypoints.server.metrics import CONTENT_TYPE as PROMETHEUS_CONTENT_TYPE
from quire.entrypoints.server.metrics import budget_families, render_families
from quire.entrypoints.server.protocol import (
    ParsedRequest,
    RequestBounds,
    get,
    parse_chat,
    parse_completion,
    parse_detokenize,
    parse_tokenize,
)
from quire.entrypoints.server.reasoning_parsers import PARSERS as REASONING
from quire.entrypoints.server.request_body import parse_json
from quire.entrypoints.server.responses import Shaper, usage
from quire.entrypoints.server.tokenizer_pool import TokenizerPool
from quire.entrypoints.server.tool_parsers import PARSERS
from quire.lora.request import LoRARequest
from quire.multimodal.inputs import MMItem
from quire.outputs import RequestOutput
from quire.sampling_params import SamplingParams

#: Seconds a client told "overloaded" should wait before trying again.
RETRY_AFTER_S = 1
#: The smallest share of ``max_stream_backlog`` one prompt of a request gets.
MIN_STREAM_BACKLOG = 16
#: The routes that answer errors in Anthropic's shape.
_ANTHROPIC_PATHS = frozenset({"/v1/messages"})


class _Api:
    """The route handlers; holds only what the app was created with."""

    def __init__(self, engine: AsyncEngine, served_model_name: str, api_key: str | None,
                 limits: ServerLimits, chat_template: str | None,
                 tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None) -> None:
        self.engine = engine
        self.tool_parser = PARSERS[tool_call_parser]() if tool_call_parser else None
        self.reasoning = REASONING[reasoning_parser]() if reasoning_parser else None
        self.model = served_model_name
        self.api_key = api_key
        self.limits = limits
        self.bounds = RequestBounds(
            max_prompt_bytes=limits.prompt_bytes(engine.max_model_len),
            max_stop_strings=limits.max_stop_strings,
            max_stop_string_chars=limits.max_stop_string_chars,
            max_sequences=limits.max_sequences_per_request,
            max_prompts=min(limits.max_sequences_per_request, engine.max_waiting_requests))
        self.chat_template = chat_template
        #: How chat requests' images are loaded and preprocessed (on the pool).
        self.images = ImageSupport(engine.image_inputs, engine.media_policy)
        self.pool = TokenizerPool(engine.tokenizer)
        self.created = int(time.time())
        #: LoRA adapters served, by name (``--lora-modules`` and the load route); ids are
        #: never reused, so an unloaded adapter's id cannot mean another's.
        self.loras: dict[str, LoRARequest] = {}
        self._lora_ids = itertools.count(1)

    # -- request checks --------------------------------------------------------------------
    def check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        token = header[7:] if header.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(token.encode(), self.api_key.encode()):
            raise APIError(401, "invalid or missing API key (Authorization: Bearer ...)",
                           type="authentication_error", code="invalid_api_key")

    async def read_json(self, request: Request) -> dict[str, Any]:
        """The body as a JSON object: at most ``max_body_bytes`` (413), arrived within
        ``body_timeout_s`` (408), parsed off the event loop (400 naming what is wrong)."""
        limit = self.limits.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise self._too_large()
        try:
            raw = await asyncio.wait_for(self._read_body(request, limit),
                                         self.limits.body_timeout_s)
        except asyncio.TimeoutError:
            raise APIError(408, f"the request body did not arrive within "
                                f"{self.limits.body_timeout_s:g}s (--body-timeout)",
                           code="request_timeout", headers={"Connection": "close"}) from None
        return await self.pool.run(lambda tokenizer: parse_json(raw))

    async def _read_body(self, request: Request, limit: int) -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():  # counts bodies sent without a length too
            size += len(chunk)
            if size > limit:
                raise self._too_large()
            chunks.append(chunk)
        return b"".join(chunks)

    def _too_large(self) -> APIError:
        return APIError(413, f"the body is larger than {self.limits.max_body_bytes} bytes "
                             f"(--max-body-bytes)", code="request_too_large",
                        headers={"Connection": "close"})

    def check_model(self, body: dict[str, Any], required: bool = False) -> LoRARequest | None:
        """The model name first: no work for a model this server does not serve. An
        adapter's name gives its :class:`LoRARequest` (None: the base model)."""
        if required and body.get("model") is None:
            raise bad_request("model is required", param="model")
        name = get(body, "model", str, "")
        if name == self.model:
            return None
        lora = self.loras.get(name)
        if lora is None:
            served = ", ".join(repr(n) for n in [self.model, *self.loras])
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                                f"{served}", param="model", code="model_not_found")
        return lora

    async def add_lora(self, name: str, path: str) -> LoRARequest:
        """Serve the adapter at ``path`` as ``name``; a 400 naming why it cannot be."""
        if not self.engine.enable_lora:
            raise bad_request("LoRA is disabled: start the server with --enable-lora",
                              param="lora_name")
        if not name or name == self.model or name in self.loras:
            raise bad_request(f"the model name {name!r} is taken (or empty)",
                              param="lora_name")
        try:
            await self.pool.run(lambda tokenizer: self.engine.check_lora_adapter(path))
        except ValueError as exc:
            raise bad_request(str(exc), param="lora_path") from exc
        lora = LoRARequest(name, next(self._lora_ids), path)
        self.loras[name] = lora
        return lora

    def check_task(self, task: str, api: str) -> None:
        """A 400 when this model does not serve ``api`` (vLLM's answer: an embedding
        model does not generate, a generating one does not embed)."""
        if self.engine.task != task:
            hint = ("it is an embedding model: use POST /v1/embeddings" if task == "generate"
                    else "it generates; serve it with --task embed to embed with it")
            raise bad_request(f"The model does not support the {api} API: {hint}")

    async def check_grammar(self, parsed: ParsedRequest,
                            reasoning: bool = True) -> ThinkingTokens | None:
        """Compile the request's grammar on a tokenizer thread (a 400 naming its field if
        it cannot be used). With a reasoning parser, the thinking markers the core holds
        the grammar after."""
        spec = parsed.params.structured_outputs
        if spec is None:
            return None
        thinking = None
        if reasoning and self.reasoning is not None:
            thinking = self.reasoning.tokens(self.engine.tokenizer)
            if thinking is None:
                raise bad_request(f"{parsed.grammar_param}: this model's thinking markers "
                                  "are not single tokens, so a grammar cannot be held to "
                                  "the answer after them (--reasoning-parser)",
                                  param=parsed.grammar_param)
        try:
            await self.pool.run(lambda tokenizer: self.engine.check_grammar(spec))
        except ValueError as exc:
            raise bad_request(str(exc), param=parsed.grammar_param) from None
        return thinking

    async def submit(self, token_ids: list[int], params: SamplingParams,
                     prompt: str | None, abandoned: asyncio.Event,
                     num_prompts: int = 1, index: int = 0,
                     thinking: ThinkingTokens | None = None,
                     lora: LoRARequest | None = None,
                     mm: list[MMItem] | None = None) -> RequestStream:
        """Prompt ``index`` of ``num_prompts`` of one HTTP request as one engine request
        (with ``mm``, its images); engine refusals become API errors.

        Its share of the stream backlog is the limit split over the prompts (at least
        ``MIN_STREAM_BACKLOG``), so one HTTP request holds at most about the limit. Its
        priority is ``index * n``: with each sample's own offset, the k-th sequence of
        every HTTP request is admitted before the (k+1)-th of any, so a request of many
        prompts x n cannot take the whole batch ahead of the requests behind it.
        """
        backlog = max(MIN_STREAM_BACKLOG, self.limits.max_stream_backlog // num_prompts)
        try:
            return await self.engine.add_request(token_ids, params, prompt=prompt,
                                                 on_overflow=abandoned.set,
                                                 max_backlog=backlog,
                                                 priority=index * params.n,
                                                 thinking=thinking, lora_request=lora,
                                                 mm=mm)
        except Overloaded as exc:
            raise APIError(503, f"the server is overloaded: {exc}", type="server_error",
                           code="overloaded",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from exc
        except EngineStopped as exc:
            raise APIError(503, str(exc), type="server_error", code="unavailable") from exc
        except ValueError as exc:
            raise from_value_error(exc) from exc

    async def submit_embedding(self, index: int, num_inputs: int, text: str | None,
                               ids: list[int], abandoned: asyncio.Event) -> RequestStream:
        """Input ``index`` of an embeddings request as one engine request; the engine's
        refusals become 400s naming the input."""
        try:
            return await self.engine.add_request(
                ids, SamplingParams(), prompt=text, on_overflow=abandoned.set,
                priority=index, embed=True)
        except Overloaded as exc:
            raise APIError(503, f"the server is overloaded: {exc}", type="server_error",
                           code="overloaded",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from exc
        except EngineStopped as exc:
            raise APIError(503, str(exc), type="server_error", code="unavailable") from exc
        except ValueError as exc:
            name = f"input[{index}]" if num_inputs > 1 else "input"
            raise bad_request(f"{name}: {exc}", param="input") from exc

    async def submit_all(self, parsed: ParsedRequest, abandoned: asyncio.Event,
                         thinking: ThinkingTokens | None = None,
                         lora: LoRARequest | None = None) -> list[RequestStream]:
        """One engine request per prompt; all or none (a refusal aborts the others)."""
        streams: list[RequestStream] = []
        try:
            prompts = parsed.prompts()
            for i, (text, ids) in enumerate(prompts):  # images: chat's one prompt only
                streams.append(await self.submit(ids, parsed.params, text, abandoned,
                                                 len(prompts), i, thinking, lora,
                                                 parsed.mm if i == 0 else None))
        except BaseException:
            for stream in streams:
                stream.abort()
            raise
        return streams

    # -- routes ----------------------------------------------------------------------------
    def cards(self) -> list[dict[str, Any]]:
        """``/v1/models``' entries: the model, then its adapters."""
        card = {"id": self.model, "object": "model", "created": self.created,
                "owned_by": "quire", "root": self.engine.model_path,
                "max_model_len": self.engine.max_model_len}
        adapters = [{"id": name, "object": "model", "created": self.created,
                     "owned_by": "quire", "root": lora.lora_path, "parent": self.model,
                     "max_model_len": self.engine.max_model_len}
                    for name, lora in self.loras.items()]
        return [card, *adapters]

    def names(self) -> list[str]:
        """The names requests may give for this model: its own and its adapters'."""
        return [self.model, *self.loras]

    async def completions(self, request: Request, body: dict[str, Any]) -> Response:
        lora = self.check_model(body)
        self.check_task("generate", "Completions")
        parsed = await self.pool.run(parse_completion, body, self.bounds)
        return await self._generate(request, parsed, chat=False, lora=lora,
                                    model=get(body, "model", str, "") or self.model)

    async def chat(self, request: Request, body: dict[str, Any]) -> Response:
        lora = self.check_model(body)
        self.check_task("generate", "Chat Completions")
        parsed = await self.pool.run(parse_chat, body, self.chat_template, self.bounds,
                                     self.tool_parser, self.images)
        return await self._generate(request, parsed, chat=True, lora=lora,
                                    model=get(body, "model", str, "") or self.model)

    async def _generate(self, request: Request, parsed: ParsedRequest, chat: bool,
                        lora: LoRARequest | None = None,
                        model: str | None = None) -> Response:
        """:param lora: the adapter the request named; ``model`` the name it used."""
        # the reasoning parser reads chat answers only
        thinking = await self.check_grammar(parsed, reasoning=chat)
        abandoned = asyncio.Event()
        streams = await self.submit_all(parsed, abandoned, thinking, lora)
        request_id = streams[0].request_id
        request.state.request_id = request_id
        decode = self.engine.tokenizer.decode
        created = int(time.time())
        shapers = [
            Shaper(chat=chat, model=model or self.model, request_id=request_id,
                   top_logprobs=parsed.top_logprobs, decode=decode, created=created,
                   index_base=i * parsed.params.n, tools=parsed.tools,
                   tool_parser=self.tool_parser, reasoning=self.reasoning if chat else None,
                   echo_prompt=_echo_text(text, ids, decode) if parsed.echo else None)
            for i, (text, ids) in enumerate(parsed.prompts())]
        if parsed.stream:
            return EventStream(_sse(request, streams, shapers, parsed.include_usage),
                               send_timeout=self.limits.stream_send_timeout_s,
                               abandoned=abandoned)
        finals = await _collect(request, streams)
        request.state.usage = usage(*finals)
        body = shapers[0].whole(finals[0])
        for shaper, final in zip(shapers[1:], finals[1:]):
            body["choices"].extend(shaper.choices(final))
        body["usage"] = request.state.usage
        return JSONResponse(body)

    async def messages(self, request: Request, body: dict[str, Any]) -> Response:
        """Anthropic's Messages API; its errors are answered in Anthropic's shape (the
        app's error handlers choose the shape by path)."""
        lora = self.check_model(body, required=True)
        self.check_task("generate", "Messages")
        parsed = await self.pool.run(anthropic.parse_messages, body, self.chat_template,
                                     self.bounds, self.tool_parser, self.images)
        thinking = await self.check_grammar(parsed)  # a required or named tool's
        abandoned = asyncio.Event()
        stream = await self.submit(parsed.token_ids, parsed.params, parsed.prompt,
                                   abandoned, thinking=thinking, lora=lora, mm=parsed.mm)
        request.state.request_id = stream.request_id
        shaper = anthropic.MessageShaper(
            model=self.model if lora is None else lora.lora_name,
            request_id=stream.request_id,
            input_tokens=len(parsed.token_ids), max_tokens=parsed.params.max_tokens,
            tools=parsed.tools, tool_parser=self.tool_parser, reasoning=self.reasoning)
        if parsed.stream:
            return EventStream(anthropic.events(stream, shaper, request.state),
                               send_timeout=self.limits.stream_send_timeout_s,
                               abandoned=abandoned)
        [final] = await _collect(request, [stream])
        request.state.usage = usage(final)
        return JSONResponse(shaper.whole(final))

    async def embeddings(self, request: Request, body: dict[str, Any]) -> Response:
        self.check_model(body)
        self.check_task("embed", "Embeddings")
        parsed = await self.pool.run(parse_embedding, body, self.bounds)
        abandoned = asyncio.Event()
        streams: list[RequestStream] = []
        try:
            for i, (text, ids) in enumerate(parsed.inputs):
                streams.append(await self.submit_embedding(i, len(parsed.inputs), text,
                                                           ids, abandoned))
        except BaseException:
            for stream in streams:
                stream.abort()
            raise
        request.state.request_id = streams[0].request_id
        finals = await _collect(request, streams)
        if any(out.finish_reason == "abort" for out in finals):
            raise APIError(503, "the server stopped the request before its embedding was "
                                "computed", type="server_error", code="unavailable")
        response = embedding_response(finals, self.model, parsed.encoding_format)
        request.state.usage = response["usage"]
        return JSONResponse(response)

    async def tokenize(self, request: Request, body: dict[str, Any]) -> Response:
        ids = await self.pool.run(parse_tokenize, body, self.chat_template, self.bounds,
                                  self.images)
        return JSONResponse({"count": len(ids), "max_model_len": self.engine.max_model_len,
                             "tokens": ids})

    async def detokenize(self, request: Request, body: dict[str, Any]) -> Response:
        return JSONResponse({"prompt": await self.pool.run(parse_detokenize, body)})


class _Router:
    """The routes over every model served: the API key and body are checked once, then
    the request goes to the model (or adapter) its ``model`` field names. With one model
    that one answers every request, as before several could be served."""

    def __init__(self, apis: list[_Api], kv_ledger: str | None = None) -> None:
        self.apis = apis
        self.first = apis[0]
        #: The KV budget ledger the models share (their slots in order), or None.
        self.kv_ledger = kv_ledger

    def pick(self, body: dict[str, Any]) -> _Api:
        """The model ``body`` names: a 400 when several are served and it names none, a
        404 in OpenAI's shape listing the served names when none is it."""
        if len(self.apis) == 1:
            return self.first  # its own check_model answers
        name = get(body, "model", str, "")
        if not name:
            raise bad_request(f"model is required: this server serves {self._served()}",
                              param="model")
        for api in self.apis:
            if name == api.model or name in api.loras:
                return api
        raise APIError(404, f"the model {name!r} does not exist; this server serves "
                            f"{self._served()}", param="model", code="model_not_found")

    def _served(self) -> str:
        return ", ".join(repr(n) for api in self.apis for n in api.names())

    def taken(self, name: str) -> bool:
        return any(name in api.names() for api in self.apis)

    def route(self, method: str, anthropic_auth: bool = False
              ) -> Callable[[Request], Awaitable[Response]]:
        """A handler that checks the key, reads the body and calls ``method`` of the
        model it names."""
        async def handler(request: Request) -> Response:
            if anthropic_auth:
                anthropic.check_api_key(request.headers, self.first.api_key)
            else:
                self.first.check_auth(request)
            body = await self.first.read_json(request)
            return await getattr(self.pick(body), method)(request, body)
        return handler

    async def models(self, request: Request) -> Response:
        self.first.check_auth(request)
        return JSONResponse({"object": "list",
                             "data": [card for api in self.apis for card in api.cards()]})

    async def load_lora_adapter(self, request: Request) -> Response:
        """vLLM's ``POST /v1/load_lora_adapter``: ``{"lora_name", "lora_path"}``, and,
        when several models are served, ``base_model_name`` (vLLM's key in
        ``--lora-modules``) naming the one it adapts."""
        self.first.check_auth(request)
        body = await self.first.read_json(request)
        name = get(body, "lora_name", str, "")
        path = get(body, "lora_path", str, "")
        if not path:
            raise bad_request("lora_path is required", param="lora_path")
        base = get(body, "base_model_name", str, "")
        api = self._base(base)
        if name and self.taken(name):
            raise bad_request(f"the model name {name!r} is taken (or empty)",
                              param="lora_name")
        await api.add_lora(name, path)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    def _base(self, base: str) -> _Api:
        if not base:
            if len(self.apis) > 1:
                raise bad_request("base_model_name is required: this server serves "
                                  + ", ".join(repr(a.model) for a in self.apis),
                                  param="base_model_name")
            return self.first
        for api in self.apis:
            if api.model == base:
                return api
        raise APIError(404, f"the model {base!r} does not exist; this server serves "
                            + ", ".join(repr(a.model) for a in self.apis),
                       param="base_model_name", code="model_not_found")

    async def unload_lora_adapter(self, request: Request) -> Response:
        """vLLM's ``POST /v1/unload_lora_adapter``: ``{"lora_name"}``. Requests already
        running with it finish with it; later ones naming it get a 404."""
        self.first.check_auth(request)
        body = await self.first.read_json(request)
        name = get(body, "lora_name", str, "")
        for api in self.apis:
            if api.loras.pop(name, None) is not None:
                return PlainTextResponse(
                    f"Success: LoRA adapter '{name}' removed successfully.")
        raise APIError(404, f"no LoRA adapter {name!r} is loaded", param="lora_name",
                       code="model_not_found")

    async def health(self, request: Request) -> Response:
        running = all(api.engine.is_running for api in self.apis)
        return Response(status_code=200 if running else 503)

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": __version__})

    async def metrics(self, request: Request) -> Response:
        """Prometheus text, every sample labelled with its ``model``; no API key, as in
        vLLM (scrapers seldom carry one)."""
        try:
            families = [family for api in self.apis
                        for family in await api.engine.metric_families(model=api.model)]
        except (EngineStopped, TimeoutError) as exc:
            return Response(f"{exc}\n", status_code=503, media_type="text/plain")
        if self.kv_ledger is not None:
            families += self._budget()
        return Response(render_families(families), media_type=PROMETHEUS_CONTENT_TYPE)

    def _budget(self) -> list[Any]:
        """The shared KV budget's gauges, from the ledger itself: the cores' stats of an
        idle model would be stale."""
        from quire.engine.kv_budget import KVLedger

        ledger = KVLedger(self.kv_ledger)  # type: ignore[arg-type]
        try:
            with ledger.locked():
                budget, slots = ledger.budget, ledger.slots()
        finally:
            ledger.close()
        return budget_families(budget, {api.model: slot.held
                                        for api, slot in zip(self.apis, slots)})


def _echo_text(text: str | None, ids: list[int], decode: Any) -> str:
    return text if text is not None else decode(ids)


async def _collect(request: Request, streams: list[RequestStream]) -> list[RequestOutput]:
    """Every stream's whole output (its deltas added up); a client that hangs up aborts
    them all."""
    async def whole(stream: RequestStream) -> RequestOutput:
        final: RequestOutput | None = None
        async for out in stream:
            if final is None:
                final = out
            else:
                final.add(out)
        assert final is not None and final.finished
        return final

    work = asyncio.gather(*(whole(s) for s in streams))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait([work, gone], return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if work.done() and work.exception() is not None:  # the engine failed or stopped
        exc = work.exception()
        if isinstance(exc, EngineStopped):
            raise APIError(503, str(exc), type="server_error", code="unavailable")
        if isinstance(exc, (ValueError, RuntimeError)):
            raise APIError(500, str(exc), type="server_error")
    if not work.done():  # the client left: stop computing for nobody
        work.cancel()
        for stream in streams:
            stream.abort()
        with contextlib.suppress(BaseException):
            await work  # retrieve the cancellation, so nothing is logged as unretrieved
        raise APIError(499, "the client closed the connection", code="client_closed")
    return work.result()


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body was already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The outputs of several streams as they come, tagged with the stream's position."""
    if len(streams) == 1:  # the common case needs no tasks
        async for out in streams[0]:
            yield 0, out
        return
    # bounded, so a reader that falls behind leaves the outputs in the streams' own sinks,
    # whose backlog limit then cuts it
    queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = \
        asyncio.Queue(maxsize=len(streams))

    async def pump(i: int, stream: RequestStream) -> None:
        # a cancelled pump (the consumer left) puts nothing: the queue may be full forever
        try:
            async for out in stream:
                await queue.put((i, out))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put(exc)
        await queue.put(None)

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        for _ in range(len(streams)):
            while (item := await queue.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.abort()


async def _sse(request: Request, streams: list[RequestStream], shapers: list[Shaper],
               include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events; leaving early (client gone) aborts the requests."""
    finished = 0
    try:
        async for i, out in _merged(streams):
            finished += out.finished
            for chunk in shapers[i].chunks(out):
                yield f"data: {json.dumps(chunk)}\n\n"
    except (ValueError, RuntimeError, EngineStopped) as exc:  # the engine failed it midway
        err = APIError(500, str(exc), type="server_error")
        yield f"data: {json.dumps(err.body())}\n\n"
    finally:
        for stream in streams:
            stream.abort()
    request.state.usage = _sum_usage([shaper.usage() for shaper in shapers])
    if include_usage and finished:
        yield f"data: {json.dumps(shapers[0].chunk([], request.state.usage))}\n\n"
    yield "data: [DONE]\n\n"


def _sum_usage(parts: list[dict[str, int]]) -> dict[str, int]:
    return {key: sum(part[key] for part in parts) for key in parts[0]}


@dataclass(frozen=True)
class ServedModel:
    """One model a server serves, with its name and its own request-side options.

    :param chat_template: a Jinja template used instead of the tokenizer's own.
    :param tool_call_parser: the model family's tool-call format, for ``tool_choice:
        "auto"`` (a name of :data:`~quire.entrypoints.server.tool_parsers.PARSERS`).
    :param reasoning_parser: the model's thinking format, kept apart from the answer (a
        name of :data:`~quire.entrypoints.server.reasoning_parsers.PARSERS`).
    :param lora_modules: (name, path) of LoRA adapters served from the start.
    """

    name: str
    engine: AsyncEngine
    chat_template: str | None = None
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    lora_modules: Sequence[tuple[str, str]] = ()


def create_app(async_engine: AsyncEngine, served_model_name: str, api_key: str | None = None,
               limits: ServerLimits | None = None,
               chat_template: str | None = None,
               tool_call_parser: str | None = None,
               reasoning_parser: str | None = None,
               lora_modules: Sequence[tuple[str, str]] = ()) -> Starlette:
    """The HTTP app for ``async_engine``, answering to the model name ``served_model_name``
    (the other parameters as :class:`ServedModel`'s and :func:`create_models_app`'s).

    :raises ValueError: for an adapter that cannot be served (naming it and why).
    """
    return create_models_app([ServedModel(served_model_name, async_engine, chat_template,
                                          tool_call_parser, reasoning_parser, lora_modules)],
                             api_key, limits)


def create_models_app(models: Sequence[ServedModel], api_key: str | None = None,
                      limits: ServerLimits | None = None,
                      kv_ledger: str | None = None) -> Starlette:
    """The HTTP app for one or more models, each request going to the one its ``model``
    field names.

    :param api_key: when set, ``/v1/*`` and the tokenizer routes need
        ``Authorization: Bearer <api_key>``.
    :param limits: what one client may ask (default: ``ServerLimits()``).
    :param kv_ledger: the KV budget ledger the models share, a slot each in their order
        (:mod:`quire.engine.kv_budget`), for its gauges in ``/metrics``.
    :raises ValueError: for two models or adapters of one name, or an adapter that
        cannot be served (naming it and why).
    """
    limits = limits or ServerLimits()
    apis = [_Api(m.engine, m.name, api_key, limits, m.chat_template, m.tool_call_parser,
                 m.reasoning_parser) for m in models]
    router = _Router(apis, kv_ledger)
    names = [m.name for m in models]
    if len(set(names)) < len(names):
        raise ValueError(f"two models are served by one name: {names}")
    for model, api in zip(models, apis):
        for name, path in model.lora_modules:
            if not model.engine.enable_lora:
                raise ValueError("LoRA modules given, but LoRA is disabled: add "
                                 "--enable-lora")
            if router.taken(name):
                raise ValueError(f"LoRA module name {name!r} is taken")
            try:
                model.engine.check_lora_adapter(path)
            except ValueError as exc:
                raise ValueError(f"LoRA module {name!r}: {exc}") from None
            api.loras[name] = LoRARequest(name, next(api._lora_ids), path)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        for model in models:
            if not model.engine.is_running:
                model.engine.start()
        yield
        await asyncio.gather(*(model.engine.shutdown() for model in models))
        for api in apis:
            api.pool.close()

    async def on_api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return _shaped(request.url.path, exc)

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return _shaped(request.url.path, APIError(exc.status_code, str(exc.detail)))

    async def on_disconnect(request: Request, exc: Exception) -> Response:
        return _shaped(request.url.path, APIError(499, "the client closed the connection",
                                                  code="client_closed"))

    routes = [
        Route("/v1/models", router.models, methods=["GET"]),
        Route("/v1/load_lora_adapter", router.load_lora_adapter, methods=["POST"]),
        Route("/v1/unload_lora_adapter", router.unload_lora_adapter, methods=["POST"]),
        Route("/v1/completions", router.route("completions"), methods=["POST"]),
        Route("/v1/chat/completions", router.route("chat"), methods=["POST"]),
        Route("/v1/embeddings", router.route("embeddings"), methods=["POST"]),
        Route("/v1/messages", router.route("messages", anthropic_auth=True),
              methods=["POST"]),
        Route("/tokenize", router.route("tokenize"), methods=["POST"]),
        Route("/detokenize", router.route("detokenize"), methods=["POST"]),
        Route("/health", router.health, methods=["GET"]),
        Route("/version", router.version, methods=["GET"]),
        Route("/metrics", router.metrics, methods=["GET"]),
        *Dashboard().routes(),
    ]
    handlers = {APIError: on_api_error, HTTPException: on_http_error,
                ClientDisconnect: on_disconnect}
    middleware = [Middleware(AccessLog), Middleware(ErrorShield, shape=_shaped)]
    app = Starlette(routes=routes, lifespan=lifespan, middleware=middleware,
                    exception_handlers=handlers)  # type: ignore[arg-type]
    #: the models' handlers, which the gRPC service answers through too
    #: (:mod:`quire.entrypoints.grpc.service`)
    app.state.router = router
    return app


def _shaped(path: str, exc: APIError) -> Response:
    """``exc`` in the error shape of the route at ``path``."""
    if path in _ANTHROPIC_PATHS:
        return anthropic.error_response(exc)
    return exc.response()
