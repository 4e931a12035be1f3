"""uvicorn's HTTP/1.1 protocol with a deadline on request headers, against slowloris.

uvicorn bounds the idle time between requests (``timeout_keep_alive``) but not the time
a client takes to send a request's headers: one byte a second keeps a connection, and
its slot under ``limit_concurrency``, forever. Here a connection whose headers are not
complete ``header_timeout_s`` after it opened, or after the first byte of each later
request on it, is closed. The body's deadline is the app's (``ServerLimits.body_timeout_s``).

Each request's scope also carries ``extensions[ABORT_CONNECTION]``, a callable that drops
the connection at once: when a client stops reading its stream, uvicorn's own close would
wait for the unread bytes to drain, which they never do.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from quire.entrypoints.server.errors import ABORT_CONNECTION

logger = logging.getLogger(__name__)


class _HeaderDeadline:
    """The deadline, for either parser; a subclass says when headers are awaited.

    Armed at connection open; re-armed when a request's first byte arrives on an idle
    keep-alive connection; dropped once the headers are complete.
    """

    #: Set by :func:`http_protocol_class`.
    header_timeout_s: float
    _header_timer: asyncio.TimerHandle | None = None
    # uvicorn's, for the type checker
    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop
    client: tuple[str, int] | None

    def _awaiting_headers(self) -> bool:
        """Whether some, but not all, of a request's headers have arrived."""
        raise NotImplementedError

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._start_header_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)  # type: ignore[misc]
        self._follow_headers()
        scope = getattr(self, "scope", None)  # the newest request's, once its head is in
        if scope is not None:
            scope.setdefault("extensions", {})[ABORT_CONNECTION] = self.transport.abort

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        self._follow_headers()  # a pipelined request may have begun meanwhile

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header_timer()
        super().connection_lost(exc)  # type: ignore[misc]

    def _follow_headers(self) -> None:
        if self.transport.is_closing() or not self._awaiting_headers():
            self._stop_header_timer()
        elif self._header_timer is None:
            self._start_header_timer()

    def _start_header_timer(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _stop_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
            logger.warning("%s: request headers not complete within %gs (--header-timeout); "
                           "connection closed", client, self.header_timeout_s)
            self.transport.close()


class _H11HeaderDeadline(_HeaderDeadline, H11Protocol):
    def _awaiting_headers(self) -> bool:
        # h11 holds back a request until its headers are complete: until then the peer
        # is IDLE with bytes buffered (IDLE with none is an idle keep-alive connection).
        return self.conn.their_state is h11.IDLE and bool(self.conn.trailing_data[0])


def _httptools_class() -> type | None:
    """The deadline over uvicorn's httptools protocol, or None without httptools."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return None

    class _HttpToolsHeaderDeadline(_HeaderDeadline, HttpToolsProtocol):
        _in_headers = False

        def _awaiting_headers(self) -> bool:
            return self._in_headers

        def on_message_begin(self) -> None:
            self._in_headers = True
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            self._in_headers = False
            super().on_headers_complete()

    return _HttpToolsHeaderDeadline


def http_protocol_class(header_timeout_s: float) -> type[asyncio.Protocol]:
    """The class to pass as ``uvicorn.Config(http=...)``: httptools' protocol when
    httptools is installed, else h11's (as uvicorn's "auto"), with the header deadline.

    :raises ValueError: unless ``header_timeout_s`` is a finite number > 0.
    """
    if not 0 < header_timeout_s < float("inf"):
        raise ValueError(f"header_timeout_s must be a number of seconds > 0, "
                         f"got {header_timeout_s!r}")
    base: Any = _httptools_class() or _H11HeaderDeadline
    return type(base.__name__, (base,), {"header_timeout_s": float(header_timeout_s)})
