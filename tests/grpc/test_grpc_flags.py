"""``quire serve``'s gRPC flags: each bad value is one line naming its flag, told before
the model is fetched or loaded; and the ``GrpcOptions`` they make."""

from __future__ import annotations

import socket

import pytest
from quire.entrypoints.cli import main
from quire.entrypoints.grpc.server import GrpcOptions
from serve_flags import one_line




@pytest.fixture
def pem(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_text("-----BEGIN CERTIFICATE-----\n")
    key.write_text("-----BEGIN PRIVATE KEY-----\n")
    return str(cert), str(key)


@pytest.mark.parametrize(("flags", "error"), [
    (["--no-http"], "--no-http: needs --grpc-port"),
    (["--grpc-tls-cert", "x.pem"], "--grpc-tls-cert: needs --grpc-port"),
    (["--grpc-port", "70000"], "--grpc-port: must be 0-65535"),
    (["--grpc-port", "0", "--grpc-tls-cert", "CERT"], "--grpc-tls-key: TLS needs both"),
    (["--grpc-port", "0", "--grpc-tls-key", "KEY"], "--grpc-tls-cert: TLS needs both"),
    (["--grpc-port", "0", "--grpc-tls-cert", "/nonexistent/c.pem", "--grpc-tls-key", "KEY"],
     "--grpc-tls-cert: no such file: /nonexistent/c.pem"),
    (["--grpc-port", "0", "--grpc-tls-cert", "CERT", "--grpc-tls-key", "NOTPEM"],
     "--grpc-tls-key: "),
])
def test_a_bad_grpc_flag_is_one_line_naming_it(nothing_loads, capsys, tmp_path, pem, flags,
                                               error):
    not_pem = tmp_path / "plain.txt"
    not_pem.write_text("hello")
    flags = [{"CERT": pem[0], "KEY": pem[1], "NOTPEM": str(not_pem)}.get(f, f) for f in flags]
    assert main(["serve", "--model", str(tmp_path), *flags]) == 2
    line = one_line(capsys)
    assert line.startswith(f"quire serve: error: {error}"), line
    if "NOTPEM" in error:
        assert "not a PEM file" in line


@pytest.mark.parametrize("layout", [[], ["--api-server-count", "2"], ["--no-http"]])
def test_a_grpc_port_in_use_is_refused_before_the_model_loads(nothing_loads, capsys,
                                                               tmp_path, layout):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = main(["serve", "--model", str(tmp_path), "--port", "0", "--grpc-port",
                     str(port), *layout])
    assert code == 2
    assert one_line(capsys).startswith(
        f"quire serve: error: --grpc-port: 127.0.0.1:{port} is already in use")


def test_grpc_options_are_checked_on_creation(tmp_path):
    with pytest.raises(ValueError, match="port must be"):
        GrpcOptions("127.0.0.1", 70000)
    with pytest.raises(ValueError, match="tls_cert and tls_key go together"):
        GrpcOptions("127.0.0.1", 0, tls_cert="c.pem")
    with pytest.raises(ValueError, match="tls_key: cannot read"):
        GrpcOptions("127.0.0.1", 0, tls_cert="c.pem", tls_key=str(tmp_path / "no")
                    ).credentials()
    assert GrpcOptions("::1", 5).address == "[::1]:5"
