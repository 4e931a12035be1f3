"""``quire serve``'s gRPC flags: ``--grpc-port``, ``--no-http``, ``--grpc-tls-cert`` and
``--grpc-tls-key``; their checks (one line naming the flag, before the model loads) and
the :class:`~quire.entrypoints.grpc.server.GrpcServer` they describe."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any

from quire.entrypoints.cli.common import UsageError
from quire.entrypoints.cli.listener import probe_port

if TYPE_CHECKING:
    from quire.entrypoints.grpc.server import GrpcServer
    from quire.entrypoints.server.limits import ServerLimits


def add_grpc_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--grpc-port", type=int, default=None, metavar="PORT",
                        help="also serve the quire.v1.Generation gRPC API (with health "
                             "and reflection) on this port of --host; 0: any free one, "
                             "told in the start line (default: no gRPC)")
    parser.add_argument("--no-http", action="store_true",
                        help="serve gRPC only (needs --grpc-port): no HTTP port is bound, "
                             "so no /metrics either")
    parser.add_argument("--grpc-tls-cert", default=None, metavar="FILE",
                        help="PEM certificate chain: serve gRPC over TLS (with "
                             "--grpc-tls-key)")
    parser.add_argument("--grpc-tls-key", default=None, metavar="FILE",
                        help="PEM private key of --grpc-tls-cert")


def check_grpc_flags(args: argparse.Namespace) -> None:
    """The gRPC flags that need no model.

    :raises UsageError: naming the first flag whose value is refused.
    """
    if args.grpc_port is None:
        for flag, value in (("--no-http", args.no_http), ("--grpc-tls-cert",
                                                          args.grpc_tls_cert),
                            ("--grpc-tls-key", args.grpc_tls_key)):
            if value:
                raise UsageError(f"{flag}: needs --grpc-port (the gRPC server's port)")
        return
    if (args.grpc_tls_cert is None) != (args.grpc_tls_key is None):
        missing = "--grpc-tls-key" if args.grpc_tls_key is None else "--grpc-tls-cert"
        raise UsageError(f"{missing}: TLS needs both --grpc-tls-cert and --grpc-tls-key")
    for flag, path in (("--grpc-tls-cert", args.grpc_tls_cert),
                       ("--grpc-tls-key", args.grpc_tls_key)):
        if path is not None:
            _check_pem(flag, path)


def _check_pem(flag: str, path: str) -> None:
    if not os.path.isfile(path):
        raise UsageError(f"{flag}: no such file: {path}")
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16)
    except OSError as exc:
        raise UsageError(f"{flag}: cannot read {path}: {exc.strerror}") from exc
    if b"-----BEGIN " not in head:
        raise UsageError(f"{flag}: {path} is not a PEM file (no -----BEGIN line)")


def settle_grpc_port(args: argparse.Namespace) -> None:
    """Check that ``--grpc-port`` can be bound, now rather than after the model loaded,
    and turn 0 into the free port picked, so that every API server binds the same one
    (they parse ``args.argv`` again: the port is appended to it).

    :raises UsageError: naming ``--grpc-port`` (in use, privileged) or ``--host``.
    """
    if args.grpc_port is None:
        return
    if args.grpc_port and args.grpc_port == args.port and not args.no_http:
        raise UsageError(f"--grpc-port: {args.grpc_port} is --port, the HTTP port; choose "
                         "another")
    port = probe_port(args.host, args.grpc_port, "--grpc-port")
    if port != args.grpc_port:
        args.grpc_port = port
        args.argv = [*args.argv, "--grpc-port", str(port)]


def grpc_server(args: argparse.Namespace, limits: ServerLimits, app: Any,
                api_key: str | None) -> GrpcServer | None:
    """The gRPC server of ``app``'s models (None without ``--grpc-port``)."""
    if args.grpc_port is None:
        return None
    from quire.entrypoints.grpc.server import GrpcOptions, GrpcServer

    options = GrpcOptions(host=args.host, port=args.grpc_port,
                          tls_cert=args.grpc_tls_cert, tls_key=args.grpc_tls_key,
                          reuse_port=args.api_server_count > 1,
                          max_message_bytes=limits.max_body_bytes)
    return GrpcServer(app.state.router, options, api_key)
