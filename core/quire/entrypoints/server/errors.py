"""API errors in OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``),
and :class:`ErrorShield`, which turns a fault of ours into a 500 without losing the
connection."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(__name__)

#: The ASGI extension through which the HTTP protocol lets the app drop a connection at
#: once (see :mod:`quire.entrypoints.server.http_protocol`); without it uvicorn closes gracefully.
ABORT_CONNECTION = "quire.abort_connection"


class ClientTooSlow(Exception):
    """The client did not take its stream's events in time; its connection is closed."""


class APIError(Exception):
    """An error answered to the client; ``status`` is the HTTP status code."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def _known_params() -> frozenset[str]:
    from dataclasses import fields

    from quire.sampling_params import SamplingParams

    return frozenset(f.name for f in fields(SamplingParams)) | {
        "prompt", "messages", "max_completion_tokens", "top_logprobs"}


#: Request fields a ValueError's message may start with.
_PARAMS = _known_params()


def from_value_error(exc: ValueError) -> APIError:
    """A 400 naming the field: quire's checks start their message with the field's name
    (``SamplingParams``) or speak of "the prompt" (the engine's length and id checks)."""
    message = str(exc)
    first = message.split(" ", 1)[0].rstrip(":,").split("[", 1)[0]  # logit_bias[5]
    if first in _PARAMS:
        param: str | None = first
    elif message.startswith("the prompt"):
        param = "prompt"
    else:
        param = None
    return APIError(400, message, param=param)


class ErrorShield:
    """ASGI middleware, inside the access log: an exception that no handler turned into a
    response becomes a 500 in the route's error shape (``shape``), logged once with its
    traceback, and the connection stays usable. Once a response has begun nothing can be
    answered any more: the connection is dropped (a client too slow for its stream is
    logged as such, without a traceback)."""

    def __init__(self, app: ASGIApp, shape: Callable[[str, APIError], Response]) -> None:
        self.app = app
        self.shape = shape

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = [False]

        async def watch(message: Message) -> None:
            if message["type"] == "http.response.start":
                started[0] = True
            await send(message)

        path = scope.get("path", "")
        try:
            await self.app(scope, receive, watch)
        except ClientTooSlow as exc:
            logger.warning("%s %s: closing the connection: the client is too slow: %s",
                           _client(scope), path, exc)
            _drop(scope)
        except Exception as exc:
            logger.exception("%s %s: internal error", _client(scope), path)
            if started[0]:
                _drop(scope)
                return
            error = APIError(500, f"internal error: {type(exc).__name__}: {exc}",
                             type="server_error")
            await self.shape(path, error)(scope, receive, send)


def _client(scope: Scope) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "-"


def _drop(scope: Scope) -> None:
    abort = scope.get("extensions", {}).get(ABORT_CONNECTION)
    if abort is not None:
        abort()
