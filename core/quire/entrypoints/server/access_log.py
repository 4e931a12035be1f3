"""One access-log line per HTTP request: method, path, status, request id, tokens, latency.

A plain ASGI middleware, so it sees streamed responses end (the line is written when the
last body chunk has gone, with the whole stream's latency). Handlers leave what they know
in ``request.state`` (Starlette keeps it in ``scope["state"]``): ``request_id`` and
``usage`` (the OpenAI usage dict); the middleware owns nothing else.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger("quire.access")


class AccessLog:
    """Wraps ``app``; logs on the ``quire.access`` logger at INFO."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.monotonic()
        state: dict[str, Any] = scope.setdefault("state", {})
        # status None: nothing sent yet (if the app raises, the outer error handler
        # answers 500)
        status: list[int | None] = [None]
        logged = [False]

        async def send_and_watch(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                logged[0] = True
                _log(scope, state, status[0] or 500, start)

        try:
            await self.app(scope, receive, send_and_watch)
        finally:
            if not logged[0]:  # the client left mid-stream, or the app raised
                _log(scope, state, status[0] or 500, start, cut=status[0] is not None)


def _log(scope: Scope, state: dict[str, Any], status: int, start: float,
         cut: bool = False) -> None:
    if not logger.isEnabledFor(logging.INFO):
        return
    client = scope.get("client")
    usage = state.get("usage") or {}
    logger.info(
        '%s "%s %s" %d id=%s prompt_tokens=%s completion_tokens=%s latency=%.3fs%s',
        f"{client[0]}:{client[1]}" if client else "-", scope.get("method", "-"),
        scope.get("path", "-"), status, state.get("request_id", "-"),
        usage.get("prompt_tokens", "-"), usage.get("completion_tokens", "-"),
        time.monotonic() - start, " (cut short)" if cut else "")
