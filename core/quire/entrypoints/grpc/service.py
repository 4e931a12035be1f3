"""``quire.v1.Generation``'s calls, answered through the HTTP app's per-model handlers.

A call's message becomes the JSON body HTTP would have had (``/v1/completions``,
``/v1/embeddings``, ``/tokenize``, ``/detokenize``: same field names, only the fields
the message sets), and goes the HTTP way: the API key, the model it names, the same
parse on a tokenizer thread (types, ``ServerLimits``, ``SamplingParams``' ranges), the
same ``submit`` into the same :class:`AsyncEngine`. An :class:`APIError` becomes the
status code of :data:`STATUS` (``INVALID_ARGUMENT`` naming the field; an overloaded
server's ``RESOURCE_EXHAUSTED`` with ``retry-after`` in the trailing metadata).

A call that is cancelled or passes its deadline is cancelled by grpc; leaving the output
stream then aborts its engine request, which frees its pages (:class:`RequestStream`).
Requests are decoded by :func:`generic_handler`, not by grpc: a message that does not
decode is then ``INVALID_ARGUMENT`` (grpc's own decoding failure is ``INTERNAL``). It also
writes one ``quire.access`` line per call, as HTTP's access log does: peer, method,
status, request id and tokens (Generate's), latency.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
from google.protobuf.message import DecodeError

from quire.entrypoints.server.app import RETRY_AFTER_S
from quire.entrypoints.server.async_engine import EngineStopped, RequestStream
from quire.entrypoints.server.embeddings import parse_embedding
from quire.entrypoints.server.errors import APIError, ClientTooSlow, bad_request
from quire.entrypoints.server.protocol import (
    parse_completion,
    parse_detokenize,
    parse_tokenize,
)
from quire.outputs import CompletionOutput

if TYPE_CHECKING:
    from quire.entrypoints.server.app import _Api, _Router
    from quire.lora.request import LoRARequest

T = TypeVar("T")

#: HTTP status of an :class:`APIError` -> gRPC status code.
STATUS: dict[int, grpc.StatusCode] = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED,
    500: grpc.StatusCode.INTERNAL,
}
#: The trailing metadata key naming the request field an error is about.
PARAM_KEY = "quire-error-param"

access_log = logging.getLogger("quire.access")

#: GenerateRequest fields copied into the completions body as they are, when set.
_SCALARS = ("n", "max_tokens", "temperature", "top_p", "top_k", "min_p",
            "presence_penalty", "frequency_penalty", "repetition_penalty", "seed",
            "min_tokens", "ignore_eos", "include_stop_str_in_output",
            "skip_special_tokens", "logprobs", "use_beam_search", "best_of",
            "length_penalty")
#: ``early_stopping``'s words, as HTTP's JSON values (anything else is passed on, and
#: refused there naming the field).
_EARLY_STOPPING = {"true": True, "false": False, "never": "never"}


class GenerationService:
    """The servicer: one per API server, over the app's router (every model served).

    :param router: ``app.state.router`` of :func:`~quire.entrypoints.server.app.create_models_app`.
    :param api_key: when set, every call needs ``authorization: Bearer <api_key>``.
    :param pb2: the generated message module (:func:`~quire.entrypoints.grpc.stubs.load_stubs`).
    """

    def __init__(self, router: _Router, api_key: str | None, pb2: ModuleType) -> None:
        self.router = router
        self.api_key = api_key
        self.pb2 = pb2

    # -- calls -----------------------------------------------------------------------------
    async def Generate(self, request: Any, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[Any]:
        try:
            api, lora = self._model(context, request.model)
            api.check_task("generate", "Generate")
            parsed = await api.pool.run(parse_completion, completion_body(request),
                                        api.bounds)
            thinking = await api.check_grammar(parsed, reasoning=False)
            abandoned = asyncio.Event()
            [stream] = await api.submit_all(parsed, abandoned, thinking, lora)
            async for response in self._responses(api, stream, parsed.top_logprobs):
                yield response
        except APIError as exc:
            await _abort(context, exc)
        except EngineStopped as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except ClientTooSlow as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"the client is too slow: {exc} (--max-stream-backlog)")
        except (ValueError, RuntimeError) as exc:  # the engine failed the request midway
            await context.abort(grpc.StatusCode.INTERNAL, str(exc))

    async def Embed(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._answer(context, self._embed(request, context))

    async def Tokenize(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def tokenize() -> Any:
            api, _ = self._model(context, request.model)
            body: dict[str, Any] = {"prompt": request.prompt}
            if request.HasField("add_special_tokens"):
                body["add_special_tokens"] = request.add_special_tokens
            ids = await api.pool.run(parse_tokenize, body, api.chat_template, api.bounds,
                                     api.images)
            return self.pb2.TokenizeResponse(token_ids=ids,
                                             max_model_len=api.engine.max_model_len)
        return await self._answer(context, tokenize())

    async def Detokenize(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def detokenize() -> Any:
            api, _ = self._model(context, request.model)
            text = await api.pool.run(parse_detokenize, {"tokens": list(request.tokens)})
            return self.pb2.DetokenizeResponse(text=text)
        return await self._answer(context, detokenize())

    async def ListModels(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def models() -> Any:
            self._check_auth(context)
            return self.pb2.ListModelsResponse(models=[
                self.pb2.Model(id=card["id"], root=card["root"] or "",
                               parent=card.get("parent", ""),
                               max_model_len=card["max_model_len"], task=api.engine.task)
                for api in self.router.apis for card in api.cards()])
        return await self._answer(context, models())

    # -- pieces ----------------------------------------------------------------------------
    def _check_auth(self, context: grpc.aio.ServicerContext) -> None:
        if self.api_key is None:
            return
        header = dict(context.invocation_metadata() or ()).get("authorization", "")
        token = header[7:] if isinstance(header, str) and \
            header.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(token.encode(), self.api_key.encode()):
            raise APIError(401, "invalid or missing API key (metadata authorization: "
                                "Bearer ...)")

    def _model(self, context: grpc.aio.ServicerContext, name: str
               ) -> tuple[_Api, LoRARequest | None]:
        """The key first, then the model ``name`` picks (empty: the only one served)."""
        self._check_auth(context)
        if not name and len(self.router.apis) == 1:
            return self.router.first, None
        api = self.router.pick({"model": name})
        return api, api.check_model({"model": name})

    async def _answer(self, context: grpc.aio.ServicerContext, work: Awaitable[T]) -> T:
        try:
            return await work
        except APIError as exc:
            await _abort(context, exc)
        except EngineStopped as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        raise AssertionError("context.abort returns only by raising")

    async def _responses(self, api: _Api, stream: RequestStream, top: int | None
                         ) -> AsyncIterator[Any]:
        """A message per delta output; the last one carries the usage."""
        pb2, decode = self.pb2, api.engine.tokenizer.decode
        prompt_tokens = completion_tokens = 0
        async for out in stream:
            prompt_tokens = prompt_tokens or len(out.prompt_token_ids)
            choices = [_choice(pb2, c, top, decode) for c in out.outputs
                       if c.token_ids or c.text or c.finish_reason]
            completion_tokens += sum(len(c.token_ids) for c in out.outputs)
            message = pb2.GenerateResponse(request_id=out.request_id, choices=choices)
            if out.finished:
                message.usage.CopyFrom(pb2.Usage(
                    prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                    total_tokens=prompt_tokens + completion_tokens))
            if choices or out.finished:
                yield message

    async def _embed(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        api, _ = self._model(context, request.model)
        api.check_task("embed", "Embed")
        parsed = await api.pool.run(parse_embedding, {"input": embed_input(request)},
                                    api.bounds)
        abandoned = asyncio.Event()
        streams: list[RequestStream] = []
        try:
            for i, (text, ids) in enumerate(parsed.inputs):
                streams.append(await api.submit_embedding(i, len(parsed.inputs), text, ids,
                                                          abandoned))
            finals = await asyncio.gather(*(_last(s) for s in streams))
        finally:
            for stream in streams:
                stream.abort()
        if any(out.finish_reason == "abort" for out in finals):
            raise APIError(503, "the server stopped the request before its embedding was "
                                "computed", code="unavailable")
        tokens = sum(len(out.prompt_token_ids) for out in finals)
        return self.pb2.EmbedResponse(
            model=api.model,
            embeddings=[self.pb2.Embedding(index=i, values=out.embedding)
                        for i, out in enumerate(finals)],
            usage=self.pb2.Usage(prompt_tokens=tokens, total_tokens=tokens))


def generic_handler(service: GenerationService, service_name: str) -> grpc.GenericRpcHandler:
    """``service``'s methods as grpc handlers, each request decoded in the handler (see
    the module's docstring); the methods are read from the proto's descriptor."""
    pb2 = service.pb2
    methods = pb2.DESCRIPTOR.services_by_name[service_name.rpartition(".")[2]].methods_by_name
    handlers = {}
    for name, method in methods.items():
        request_type = getattr(pb2, method.input_type.name)
        if method.server_streaming:
            handlers[name] = grpc.unary_stream_rpc_method_handler(
                _streaming(getattr(service, name), request_type),
                response_serializer=_serialize)
        else:
            handlers[name] = grpc.unary_unary_rpc_method_handler(
                _unary(getattr(service, name), request_type), response_serializer=_serialize)
    return grpc.method_handlers_generic_handler(service_name, handlers)


def _serialize(message: Any) -> bytes:
    return bytes(message.SerializeToString())


async def _decode(request_type: Any, raw: bytes, context: grpc.aio.ServicerContext) -> Any:
    try:
        return request_type.FromString(raw)
    except DecodeError as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"the request is not a {request_type.DESCRIPTOR.full_name}: {exc}")


def _unary(behavior: Callable[..., Awaitable[Any]], request_type: Any
           ) -> Callable[[bytes, grpc.aio.ServicerContext], Awaitable[Any]]:
    async def handler(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        call, code = _CallInfo.of(context), grpc.StatusCode.OK
        try:
            return await behavior(await _decode(request_type, raw, context), context)
        except BaseException as exc:
            code = _code_of(exc, context, call)
            raise
        finally:
            _log_call(call, behavior.__name__, code)
    return handler


def _streaming(behavior: Callable[..., AsyncIterator[Any]], request_type: Any
               ) -> Callable[[bytes, grpc.aio.ServicerContext], AsyncIterator[Any]]:
    async def handler(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        call, code, last = _CallInfo.of(context), grpc.StatusCode.OK, None
        try:
            async for message in behavior(await _decode(request_type, raw, context),
                                          context):
                last = message
                yield message
        except BaseException as exc:
            code = _code_of(exc, context, call)
            raise
        finally:
            _log_call(call, behavior.__name__, code, last)
    return handler


@dataclass(frozen=True)
class _CallInfo:
    """What the access log and the status of a call need from its context, read when the
    call starts: once a client cancels, grpc's C core frees the call, and reading its
    peer then crashed the server (a segmentation fault in ``context.peer()``)."""

    peer: str
    start: float
    #: ``time.monotonic()`` at the deadline; None without one.
    deadline: float | None

    @classmethod
    def of(cls, context: grpc.aio.ServicerContext) -> _CallInfo:
        start, remaining = time.monotonic(), context.time_remaining()
        return cls(context.peer() or "-", start,
                   None if remaining is None else start + remaining)


def _code_of(exc: BaseException, context: grpc.aio.ServicerContext,
             call: _CallInfo) -> grpc.StatusCode:
    """The status a call that raised ``exc`` ends with."""
    if isinstance(exc, asyncio.CancelledError):
        return grpc.StatusCode.DEADLINE_EXCEEDED if call.deadline is not None and \
            time.monotonic() >= call.deadline else grpc.StatusCode.CANCELLED
    return context.code() or grpc.StatusCode.UNKNOWN


def _log_call(call: _CallInfo, method: str, code: grpc.StatusCode, last: Any = None) -> None:
    if not access_log.isEnabledFor(logging.INFO):
        return
    usage = last.usage if last is not None and last.HasField("usage") else None
    access_log.info(
        '%s "gRPC %s" %s id=%s prompt_tokens=%s completion_tokens=%s latency=%.3fs',
        call.peer, method, code.name,
        last.request_id if last is not None else "-",
        usage.prompt_tokens if usage is not None else "-",
        usage.completion_tokens if usage is not None else "-",
        time.monotonic() - call.start)


def completion_body(request: Any) -> dict[str, Any]:
    """The ``/v1/completions`` body of a ``GenerateRequest``: the fields it sets, under
    HTTP's names (the ``prompt`` oneof is HTTP's ``prompt``)."""
    body: dict[str, Any] = {name: getattr(request, name) for name in _SCALARS
                            if request.HasField(name)}
    kind = request.WhichOneof("prompt")
    if kind == "text":
        body["prompt"] = request.text
    elif kind == "token_ids":
        body["prompt"] = list(request.token_ids.ids)
    if request.stop:
        body["stop"] = list(request.stop)
    if request.stop_token_ids:
        body["stop_token_ids"] = list(request.stop_token_ids)
    if request.logit_bias:
        body["logit_bias"] = {str(k): v for k, v in request.logit_bias.items()}
    if request.allowed_token_ids:
        body["allowed_token_ids"] = list(request.allowed_token_ids)
    if request.bad_words:
        body["bad_words"] = list(request.bad_words)
    if request.HasField("early_stopping"):
        body["early_stopping"] = _EARLY_STOPPING.get(request.early_stopping,
                                                     request.early_stopping)
    if request.HasField("structured_outputs"):
        body["structured_outputs"] = structured_body(request.structured_outputs)
    return body


def structured_body(so: Any) -> dict[str, Any]:
    """HTTP's ``structured_outputs`` object; the JSON schema parsed from its text."""
    out: dict[str, Any] = {name: getattr(so, name) for name in ("regex", "grammar",
                                                                "json_object")
                           if so.HasField(name)}
    if so.choice:
        out["choice"] = list(so.choice)
    if so.HasField("json"):
        try:
            out["json"] = json.loads(so.json)
        except ValueError as exc:
            raise bad_request(f"structured_outputs.json is not JSON: {exc}",
                              param="structured_outputs") from None
    return out


def embed_input(request: Any) -> list[Any] | None:
    """HTTP's ``input``: a list of texts or of token-id lists (mixed: refused there)."""
    if not request.input:
        return None
    return [item.text if item.WhichOneof("kind") == "text" else list(item.token_ids.ids)
            for item in request.input]


def _choice(pb2: ModuleType, c: CompletionOutput, top: int | None,
            decode: Callable[[list[int]], str]) -> Any:
    choice = pb2.Choice(index=c.index, token_ids=c.token_ids, text=c.text,
                        finish_reason=c.finish_reason or "")
    if isinstance(c.stop_reason, str):
        choice.stop_reason = c.stop_reason
    elif isinstance(c.stop_reason, int):
        choice.stop_token_id = c.stop_reason
    if top is not None:
        choice.logprobs.extend(_logprobs(pb2, c, top, decode))
    return choice


def _logprobs(pb2: ModuleType, c: CompletionOutput, k: int,
              decode: Callable[[list[int]], str]) -> list[Any]:
    """One ``TokenLogprob`` per new token: the chosen one and the ``k`` most likely."""
    def text(pos: Any, tid: int) -> str:
        lp = pos[tid]
        return lp.decoded_token if lp.decoded_token is not None else decode([tid])

    out = []
    for tid, pos in zip(c.token_ids, c.logprobs or []):
        ranked = sorted((t for t in pos if pos[t].rank is not None and pos[t].rank <= k),
                        key=lambda t: pos[t].rank)
        out.append(pb2.TokenLogprob(
            token_id=tid, token=text(pos, tid), logprob=pos[tid].logprob,
            top=[pb2.TopLogprob(token_id=t, token=text(pos, t), logprob=pos[t].logprob)
                 for t in ranked]))
    return out


async def _last(stream: RequestStream) -> Any:
    final = None
    async for out in stream:
        final = out
    return final


async def _abort(context: grpc.aio.ServicerContext, exc: APIError) -> None:
    """End the call with ``exc``'s status; its message names the field (also in the
    trailing metadata), an overloaded server says when to retry."""
    code = STATUS.get(exc.status, grpc.StatusCode.INTERNAL)
    trailing: list[tuple[str, str]] = []
    if exc.status == 503:
        overloaded = exc.code == "overloaded"
        code = grpc.StatusCode.RESOURCE_EXHAUSTED if overloaded \
            else grpc.StatusCode.UNAVAILABLE
        if overloaded:
            trailing.append(("retry-after", str(RETRY_AFTER_S)))
    message = exc.message
    if exc.param:
        trailing.append((PARAM_KEY, exc.param))
        if exc.param not in message:
            message = f"{exc.param}: {message}"
    await context.abort(code, message, tuple(trailing))

