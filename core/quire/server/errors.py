"""API errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse


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
    first = message.split(" ", 1)[0].rstrip(":,")
    if first in _PARAMS:
        param: str | None = first
    elif message.startswith("the prompt"):
        param = "prompt"
    else:
        param = None
    return APIError(400, message, param=param)
