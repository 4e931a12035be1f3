"""The ``grpc.aio`` server of one API server process: ``quire.v1.Generation``, the
standard ``grpc.health.v1`` health service and server reflection, on the event loop the
HTTP app's engines run on.

:class:`GrpcServer` is started once the app's lifespan has started the engines and
stopped before they shut down (``quire serve``'s uvicorn server does both). Health says
``SERVING`` from the start until the drain begins, ``NOT_SERVING`` after; once draining,
new calls get ``UNAVAILABLE``. Several API servers bind one port together
(``SO_REUSEPORT``, which grpc sets on Linux; a single server turns it off, so that a port
another server holds is refused rather than shared).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from quire.entrypoints.grpc.service import GenerationService, generic_handler
from quire.entrypoints.grpc.stubs import load_stubs

if TYPE_CHECKING:
    from quire.entrypoints.server.app import _Router

logger = logging.getLogger(__name__)

#: The service's full name, as health checks and reflection give it.
SERVICE_NAME = "quire.v1.Generation"
#: The largest TCP port.
MAX_PORT = 65535


@dataclass(frozen=True)
class GrpcOptions:
    """How one API server serves gRPC (``quire serve``'s ``--grpc-*`` flags).

    :param host: the address to bind (``--host``).
    :param port: the port (``--grpc-port``), already settled: never 0 with several API
        servers, which must all bind the same one.
    :param tls_cert: PEM certificate chain file; with ``tls_key``, TLS on the port.
    :param tls_key: PEM private key file.
    :param reuse_port: share the port with the other API servers (``SO_REUSEPORT``).
    :param max_message_bytes: largest request message (HTTP's ``--max-body-bytes``).
    """

    host: str
    port: int
    tls_cert: str | None = None
    tls_key: str | None = None
    reuse_port: bool = False
    max_message_bytes: int = 8 * 2**20

    def __post_init__(self) -> None:
        if not 0 <= self.port <= MAX_PORT:
            raise ValueError(f"port must be 0-{MAX_PORT}, got {self.port}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: give both or neither")
        if self.max_message_bytes < 1:
            raise ValueError(f"max_message_bytes must be >= 1, got {self.max_message_bytes}")

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def credentials(self) -> grpc.ServerCredentials | None:
        """The TLS credentials of the files, or None without TLS.

        :raises ValueError: naming the file that cannot be read."""
        if self.tls_cert is None or self.tls_key is None:
            return None
        pair = []
        for name, path in (("tls_key", self.tls_key), ("tls_cert", self.tls_cert)):
            try:
                pair.append(Path(path).read_bytes())
            except OSError as exc:
                raise ValueError(f"{name}: cannot read {path}: {exc.strerror}") from None
        return grpc.ssl_server_credentials([(pair[0], pair[1])])


class GrpcServer:
    """gRPC for the models of one app (``router``), with the API key of its HTTP routes.

    Health and reflection need no key (as ``GET /health``); every Generation call does.
    """

    def __init__(self, router: _Router, options: GrpcOptions, api_key: str | None) -> None:
        self.router = router
        self.options = options
        self.api_key = api_key
        self._server: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer()

    async def start(self) -> int:
        """Bind and start; returns the port bound.

        :raises RuntimeError: the stubs cannot be loaded, or the port cannot be bound
            (one line saying which address).
        """
        pb2, _ = load_stubs()
        opts = self.options
        server = grpc.aio.server(options=[
            ("grpc.so_reuseport", 1 if opts.reuse_port else 0),
            ("grpc.max_receive_message_length", opts.max_message_bytes)])
        server.add_generic_rpc_handlers((generic_handler(
            GenerationService(self.router, self.api_key, pb2), SERVICE_NAME),))
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        try:
            creds = opts.credentials()
            if creds is None:
                port = server.add_insecure_port(opts.address)
            else:
                port = server.add_secure_port(opts.address, creds)
        except (RuntimeError, ValueError) as exc:
            raise RuntimeError(f"cannot serve gRPC on {opts.address}: {exc}") from exc
        if port == 0:  # older grpc answers 0 instead of raising
            raise RuntimeError(f"cannot serve gRPC on {opts.address}: the port is in use "
                               "or the address is not this machine's")
        await server.start()
        self._server = server
        for name in ("", SERVICE_NAME):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return port

    async def draining(self) -> None:
        """The drain began: health says ``NOT_SERVING``."""
        await self._health.enter_graceful_shutdown()

    async def stop(self, grace_s: float) -> None:
        """Refuse new calls; give running ones ``grace_s`` seconds (the drain ends them
        first), then cancel them."""
        if self._server is None:
            return
        await self.draining()
        await self._server.stop(grace_s)
        self._server = None
