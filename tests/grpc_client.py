"""gRPC clients of ``quire serve --grpc-port`` for tests: the generated stubs, channels
(plain or TLS with a self-signed certificate made by the ``openssl`` command), the API
key as metadata, and the status of a call that failed."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import grpc
from quire.entrypoints.grpc.stubs import load_stubs

pb2, pb2_grpc = load_stubs()


def self_signed(directory: Path) -> tuple[Path, Path]:
    """(certificate, key) PEM files for 127.0.0.1 and localhost, valid a day."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext",
                    "subjectAltName=DNS:localhost,IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return cert, key


def channel(address: str, cert: Path | None = None, aio: bool = False) -> Any:
    """A channel to ``address``; over TLS trusting ``cert`` when given."""
    module = grpc.aio if aio else grpc
    if cert is None:
        return module.insecure_channel(address)
    creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    return module.secure_channel(address, creds)


def bearer(key: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {key}"),)


def status(call: Any) -> tuple[grpc.StatusCode, str, dict[str, str]]:
    """Run a call (a callable) that must fail: its code, details and trailing metadata."""
    try:
        result = call()
        if hasattr(result, "__iter__") and not isinstance(result, (str, bytes)):
            list(result)  # a stream fails when read
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or "", dict(exc.trailing_metadata() or ())
    raise AssertionError("the call succeeded")
