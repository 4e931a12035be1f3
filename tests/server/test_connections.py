"""Connection bounds of ``quire serve``: a deadline on request headers (against clients
that drip them, slowloris) and a cap on connections, wired as the command wires them.

Raw sockets play the slow clients; every wait is bounded, so a missing bound fails."""

from __future__ import annotations

import logging
import select
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from quire.config import EngineConfig
from quire.engine import LLMEngine
from quire.entrypoints.cli import build_parser, parse_args
from quire.entrypoints.cli.serve import connection_options, limits_from_args
from quire.entrypoints.server.app import create_app
from quire.entrypoints.server.async_engine import AsyncEngine
from server_thread import Server

MODEL = "tiny"
#: A request whose headers never end.
ENDLESS_HEADERS = b"GET /health HTTP/1.1\r\nHost: quire\r\nX-Slow: " + b"a" * 10_000
HEADER_TIMEOUT_S = 0.5


@pytest.fixture(scope="module")
def serve(tiny_checkpoint) -> Iterator[Any]:
    """``serve(*flags) -> Server``: the app over a tiny engine, its connections bounded as
    ``quire serve *flags`` bounds them."""
    path = str(tiny_checkpoint("llama"))
    servers: list[Server] = []

    def start(*flags: str) -> Server:
        args = parse_args(build_parser(), ["serve", "--model", path, *flags])
        engine = LLMEngine(EngineConfig.from_kwargs(path, device="cpu", max_model_len=64))
        aengine = AsyncEngine(engine)
        options = connection_options(args, limits_from_args(args))
        servers.append(Server(create_app(aengine, MODEL), aengine, **options))
        return servers[-1]

    yield start
    for srv in servers:
        srv.stop()


@pytest.fixture(scope="module")
def quick(serve) -> Server:
    return serve("--header-timeout", str(HEADER_TIMEOUT_S))


@pytest.fixture
def cuts() -> Iterator[list[str]]:
    """The messages of the warnings about cut connections."""
    messages: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore
    logger = logging.getLogger("quire.entrypoints.server.http_protocol")
    logger.addHandler(handler)
    yield messages
    logger.removeHandler(handler)


def connect(srv: Server) -> socket.socket:
    host, port = srv.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def drip(sock: socket.socket, data: bytes, every_s: float = 0.2,
         limit_s: float = 8.0) -> float | None:
    """Send ``data`` a byte every ``every_s`` until the server closes the connection:
    the seconds that took, or None if it was still open after ``limit_s``."""
    start = time.monotonic()
    for i in range(len(data)):
        if time.monotonic() - start > limit_s:
            return None
        try:
            sock.sendall(data[i:i + 1])
            readable, _, _ = select.select([sock], [], [], every_s)
            if readable:
                assert sock.recv(4096) == b"", "the server answered headers it never got"
                return time.monotonic() - start
        except (ConnectionResetError, BrokenPipeError):
            return time.monotonic() - start
    return None


def get_on(sock: socket.socket) -> int:
    """The status of ``GET /health`` sent whole on ``sock`` (its body is empty)."""
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: quire\r\n\r\n")
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(4096)
        assert chunk, "connection closed before the response"
        head += chunk
    assert b"content-length: 0\r\n" in head.lower()
    return int(head.split(b" ", 2)[1])


def status(srv: Server) -> int:
    return httpx.get(srv.url + "/health", timeout=10).status_code


def test_a_client_dripping_headers_is_cut_while_others_are_served(quick, cuts):
    with connect(quick) as sock:
        client = "{}:{}".format(*sock.getsockname())
        opened = time.monotonic()
        sock.sendall(ENDLESS_HEADERS[:4])
        assert status(quick) == 200  # on another connection, meanwhile
        took = drip(sock, ENDLESS_HEADERS[4:])
        assert took is not None, "a client dripping headers was never cut"
        assert HEADER_TIMEOUT_S * 0.8 <= time.monotonic() - opened <= HEADER_TIMEOUT_S + 4
    assert len([m for m in cuts if client in m]) == 1
    assert f"{HEADER_TIMEOUT_S:g}s" in next(m for m in cuts if client in m)
    assert status(quick) == 200


def test_each_request_on_a_keep_alive_connection_has_the_deadline(quick, cuts):
    with connect(quick) as sock:
        assert get_on(sock) == 200
        time.sleep(HEADER_TIMEOUT_S * 2)  # idle between requests: keep-alive's to bound
        assert get_on(sock) == 200
        took = drip(sock, ENDLESS_HEADERS)
        assert took is not None, "the second request's headers were never cut"
        assert took <= HEADER_TIMEOUT_S + 4
    assert len(cuts) == 1


def wait_for_status(srv: Server, expected: int, limit_s: float = 5.0) -> int:
    """Poll ``/health`` until it answers ``expected`` (connections come and go in the
    server's own time); the last status."""
    deadline = time.monotonic() + limit_s
    while (got := status(srv)) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return got


def test_beyond_the_connection_cap_requests_get_503(serve):
    capped = serve("--limit-concurrency", "2", "--header-timeout", "20")
    assert wait_for_status(capped, 200) == 200
    slow = [connect(capped) for _ in range(3)]
    try:
        for sock in slow:
            sock.sendall(ENDLESS_HEADERS[:20])
        assert wait_for_status(capped, 503) == 503
    finally:
        for sock in slow:
            sock.close()
    assert wait_for_status(capped, 200) == 200
