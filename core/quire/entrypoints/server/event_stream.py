"""``EventStream``: a server-sent-events response that never waits on a client for long.

Starlette's ``StreamingResponse`` waits as long as the client takes to accept each chunk;
a client that stops reading then holds its request (and its KV pages) to the end. Here
each event must be taken within ``send_timeout`` seconds, and the stream ends at once
when ``abandoned`` is set (its request was aborted because the client left too many
outputs unread). Either way the connection is closed without completing the response:
HTTP has no other way to tell a client that its stream was cut.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from starlette.responses import StreamingResponse
from starlette.types import Send

from quire.entrypoints.server.errors import ClientTooSlow


class EventStream(StreamingResponse):
    """``text/event-stream`` from ``events``; raises :class:`ClientTooSlow` out of the
    app when the client falls behind (the app's error shield closes the connection)."""

    def __init__(self, events: AsyncIterator[str], *, send_timeout: float,
                 abandoned: asyncio.Event) -> None:
        super().__init__(events, media_type="text/event-stream")
        self._events = events
        self._send_timeout = send_timeout
        self._abandoned = abandoned
        self._sending_since: float | None = None  # loop time a pending send began
        self._cut: str | None = None  # why the stream was cut, once it was

    async def stream_response(self, send: Send) -> None:
        loop = asyncio.get_running_loop()
        watchdog = asyncio.ensure_future(self._watch(asyncio.current_task(), loop))
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            async for event in self._events:
                await self._send(send, loop, event.encode(), True)
            await self._send(send, loop, b"", False)
        except asyncio.CancelledError:
            if self._cut is None:
                raise
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
            raise ClientTooSlow(self._cut) from None
        finally:
            watchdog.cancel()
            await self._events.aclose()  # type: ignore[attr-defined]

    async def _send(self, send: Send, loop: asyncio.AbstractEventLoop, body: bytes,
                    more: bool) -> None:
        self._sending_since = loop.time()
        await send({"type": "http.response.body", "body": body, "more_body": more})
        self._sending_since = None

    async def _watch(self, streaming: asyncio.Task | None,
                     loop: asyncio.AbstractEventLoop) -> None:
        """Cancel ``streaming`` once the stream is abandoned or a send waits too long;
        one wake-up per ``send_timeout / 4`` at most, nothing per event."""
        period = self._send_timeout / 4
        while True:
            try:
                await asyncio.wait_for(self._abandoned.wait(), period)
                self._cut = "its request was aborted: too many outputs left unread"
            except asyncio.TimeoutError:
                since = self._sending_since
                if since is None or loop.time() - since < self._send_timeout:
                    continue
                self._cut = (f"it took no event for {self._send_timeout:g}s "
                             f"(--stream-send-timeout)")
            if streaming is not None:
                streaming.cancel()
            return
