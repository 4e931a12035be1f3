"""``quire serve``'s server flags: the limits, the connection bounds and the API key, from
the command line, ``--config`` and the environment, as they reach the app and uvicorn."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket

import pytest
from quire.entrypoints.cli import build_parser, main, parse_args
from quire.entrypoints.cli.serve import limits_from_args
from quire.entrypoints.server.limits import ServerLimits, flag
from serve_flags import one_line


class _Stop(Exception):
    """Raised where the fake uvicorn.Config would start serving."""


@pytest.fixture
def serve(monkeypatch, tmp_path):
    """``serve(*flags) -> {"app": create_app's kwargs, "uvicorn": uvicorn.Config's}``,
    running ``quire serve`` with the engine, the app and uvicorn faked."""
    seen: dict[str, dict] = {}

    def create_app(*args, **kw):
        seen["app"] = kw
        return "app"

    def config(app, **kw):
        seen["uvicorn"] = kw
        raise _Stop

    monkeypatch.setattr("quire.engine.LLMEngine", lambda config, registry, client: object())
    monkeypatch.setattr("quire.engine.core_proc.ProcCoreClient.start",
                        lambda config, blocked, kv_share=None: "cores")
    monkeypatch.setattr("quire.entrypoints.server.async_engine.AsyncEngine", lambda engine, **kw: object())
    monkeypatch.setattr("quire.entrypoints.server.app.create_app", create_app)
    monkeypatch.setattr("uvicorn.Config", config)
    monkeypatch.setattr("quire.entrypoints.cli.serve._configure_logging", lambda level: None)
    monkeypatch.delenv("QUIRE_API_KEY", raising=False)

    def run(*flags: str) -> dict[str, dict]:
        with pytest.raises(_Stop):
            main(["serve", "--model", str(tmp_path), "--port", "0", *flags])
        return seen

    return run


def test_every_limit_has_a_flag_defaulting_to_the_field():
    assert limits_from_args(parse_args(build_parser(), ["serve"])) == ServerLimits()
    changed = {"max_body_bytes": 5, "max_prompt_bytes": 6, "max_stop_strings": 7,
               "max_stop_string_chars": 8, "max_sequences_per_request": 9,
               "max_stream_backlog": 10, "header_timeout_s": 1.5, "body_timeout_s": 2.5,
               "stream_send_timeout_s": 3.5}
    assert set(changed) == {f.name for f in dataclasses.fields(ServerLimits)}
    argv = ["serve"] + [text for name, value in changed.items()
                        for text in (flag(name), str(value))]
    assert limits_from_args(parse_args(build_parser(), argv)) == ServerLimits(**changed)


def test_limits_and_connection_bounds_reach_the_app_and_uvicorn(serve):
    seen = serve("--max-stop-strings", "3", "--header-timeout", "2", "--body-timeout", "4",
                 "--limit-concurrency", "7", "--timeout-keep-alive", "9")
    assert seen["app"]["limits"] == ServerLimits(max_stop_strings=3, header_timeout_s=2.0,
                                                 body_timeout_s=4.0)
    options = seen["uvicorn"]
    assert options["limit_concurrency"] == 7 and options["timeout_keep_alive"] == 9
    assert issubclass(options["http"], asyncio.Protocol)
    assert options["http"].header_timeout_s == 2.0


def test_connection_bounds_default_to_a_cap_and_uvicorn_keep_alive(serve):
    options = serve()["uvicorn"]
    assert options["limit_concurrency"] == 512 and options["timeout_keep_alive"] == 5
    assert options["http"].header_timeout_s == ServerLimits().header_timeout_s
    assert serve("--limit-concurrency", "0")["uvicorn"]["limit_concurrency"] is None


def test_api_key_comes_from_the_environment_unless_a_flag_gives_one(serve, monkeypatch):
    assert serve()["app"]["api_key"] is None
    monkeypatch.setenv("QUIRE_API_KEY", "from-env")
    assert serve()["app"]["api_key"] == "from-env"
    assert serve("--api-key", "from-flag")["app"]["api_key"] == "from-flag"


def test_config_file_sets_the_server_flags_and_wins_over_the_environment(
        serve, monkeypatch, tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text("api-key: from-file\nheader-timeout: 3\nmax_stop_strings: 4\n"
                      "limit-concurrency: 8\ntimeout-keep-alive: 6\n")
    monkeypatch.setenv("QUIRE_API_KEY", "from-env")
    seen = serve("--config", str(config), "--max-stop-strings", "5")
    assert seen["app"]["api_key"] == "from-file"
    assert seen["app"]["limits"] == ServerLimits(header_timeout_s=3.0, max_stop_strings=5)
    assert seen["uvicorn"]["limit_concurrency"] == 8
    assert seen["uvicorn"]["timeout_keep_alive"] == 6


@pytest.mark.parametrize("flags, named", [
    (["--max-stop-strings", "0"], "--max-stop-strings"),
    (["--header-timeout", "0"], "--header-timeout"),
    (["--stream-send-timeout", "inf"], "--stream-send-timeout"),
    (["--limit-concurrency", "-1"], "--limit-concurrency"),
    (["--timeout-keep-alive", "0"], "--timeout-keep-alive"),
    (["--slo-ttft", "0"], "--slo-ttft"),
    (["--slo-e2e", "-1"], "--slo-e2e"),
    (["--slo-ttft", "inf"], "--slo-ttft"),
    (["--slo-e2e", "nan"], "--slo-e2e"),
])
def test_a_bad_value_is_one_line_naming_its_flag(serve, capsys, flags, named):
    assert main(["serve", *flags]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"quire serve: error: {named}: "), lines


def test_slo_flags_reach_the_engine_metrics(serve, monkeypatch):
    from quire.entrypoints.server.slo import SLOTargets

    made: list[dict] = []
    monkeypatch.setattr("quire.entrypoints.server.async_engine.AsyncEngine",
                        lambda engine, **kw: made.append(kw))
    serve("--slo-ttft", "2", "--slo-e2e", "30")
    serve()
    assert [kw["slo"] for kw in made] == [SLOTargets(2.0, 30.0), SLOTargets()]


def test_the_engine_core_runs_in_its_own_process_unless_asked(serve, monkeypatch):
    made = []
    monkeypatch.setattr("quire.engine.LLMEngine",
                        lambda config, registry, client: made.append(client))
    serve()
    serve("--engine-in-process")
    assert made == ["cores", None]


@pytest.mark.parametrize("flags, words", [
    (["--api-server-count", "0"], ["--api-server-count", ">= 1"]),
    (["--engine-in-process", "--data-parallel-size", "2"], ["--engine-in-process"]),
    (["--engine-in-process", "--api-server-count", "2"], ["--engine-in-process"]),
])
def test_bad_process_flags_are_refused_naming_the_flag(tmp_path, capsys, flags, words):
    assert main(["serve", "--model", str(tmp_path), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("quire serve: error:") and "\n" not in err
    assert all(w in err for w in words), err


# -- refused before anything loads ---------------------------------------------------------
@pytest.mark.parametrize("port", ["99999", "65536", "-1"])
def test_a_port_out_of_range_is_one_line_naming_port(nothing_loads, capsys, port):
    assert main(["serve", "--port", port]) == 2
    assert one_line(capsys).startswith("quire serve: error: --port: must be 0-65535")


@pytest.mark.parametrize("layout", [[], ["--api-server-count", "2"], ["--engine-in-process"],
                                    ["--data-parallel-size", "2"]])
def test_a_port_in_use_is_refused_naming_the_address_before_the_model_loads(
        nothing_loads, capsys, tmp_path, layout):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--model", str(tmp_path), "--port", str(port), *layout]) == 2
    line = one_line(capsys)
    assert line.startswith(f"quire serve: error: --port: 127.0.0.1:{port} is already in use")


def test_a_host_that_does_not_resolve_is_named(nothing_loads, capsys, tmp_path, monkeypatch):
    def getaddrinfo(host, *args):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    assert main(["serve", "--model", str(tmp_path), "--host", "nosuch.invalid"]) == 2
    assert one_line(capsys).startswith(
        "quire serve: error: --host: cannot resolve 'nosuch.invalid'")


def test_a_host_not_of_this_machine_is_named(nothing_loads, capsys, tmp_path):
    assert main(["serve", "--model", str(tmp_path), "--host", "192.0.2.1", "--port", "0"]) == 2
    assert one_line(capsys).startswith(
        "quire serve: error: --host: cannot bind 192.0.2.1:0: '192.0.2.1' is not an address")


@pytest.mark.parametrize("text, words", [
    (None, ["--chat-template: cannot read", "No such file"]),
    ("  \n", ["--chat-template:", "is empty"]),
    ("{% for m in messages %}{{ m.content }", ["--chat-template:", "line 1", "not a valid Jinja"]),
])
def test_a_bad_chat_template_is_refused_before_the_model_loads(
        nothing_loads, capsys, tmp_path, text, words):
    path = tmp_path / "chat.jinja"
    if text is not None:
        path.write_text(text)
    assert main(["serve", "--model", str(tmp_path), "--chat-template", str(path)]) == 2
    line = one_line(capsys)
    assert line.startswith("quire serve: error: --chat-template: ")
    assert all(w in line for w in words), line


@pytest.mark.parametrize("flags, named", [
    (["--served-model-name", ""], "--served-model-name"),
    (["--api-key", " "], "--api-key"),
    (["--device", "nope"], "--device"),
    (["--engine-in-process", "--data-parallel-size", "2"], "--engine-in-process"),
])
def test_other_flags_are_refused_before_the_model_loads(nothing_loads, capsys, tmp_path,
                                                        flags, named):
    assert main(["serve", "--model", str(tmp_path), *flags]) == 2
    assert one_line(capsys).startswith(f"quire serve: error: {named}: ")


def test_the_chat_template_reaches_the_app(serve, tmp_path):
    path = tmp_path / "chat.jinja"
    path.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert serve("--chat-template", str(path))["app"]["chat_template"] == path.read_text()


# -- the socket bound first is the one served on -------------------------------------------
class _FakeServer:
    """uvicorn's server as ``serve`` drives it: ``run(sockets)``, then ``on_started``."""

    seen: dict[str, object] = {}

    def __init__(self, config, engine, drain_s, on_started=None, grpc=None) -> None:
        self.on_started = on_started
        self.grpc_failure = None

    def run(self, sockets=None) -> None:
        (sock,) = sockets
        with socket.create_connection(sock.getsockname()[:2], timeout=5):
            pass  # it listens already
        _FakeServer.seen["port"] = sock.getsockname()[1]
        _FakeServer.seen["socket"] = sock
        self.on_started()


def test_serve_hands_the_bound_socket_to_uvicorn_and_reports_the_port(
        serve, monkeypatch, caplog, tmp_path):
    monkeypatch.setattr("uvicorn.Config", lambda app, **kw: "config")
    monkeypatch.setattr("quire.entrypoints.cli.serve._graceful_server_class",
                        lambda: _FakeServer)
    monkeypatch.setattr("quire.engine.LLMEngine", lambda config, registry, client: object())

    class Engine:
        failure = None

    monkeypatch.setattr("quire.entrypoints.server.async_engine.AsyncEngine",
                        lambda engine, **kw: Engine())
    logger = logging.getLogger("uvicorn.error")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="uvicorn.error"):
            assert main(["serve", "--model", str(tmp_path), "--port", "0"]) == 0
    finally:
        logger.removeHandler(caplog.handler)
    port = _FakeServer.seen["port"]
    assert port != 0
    assert f"Uvicorn running on http://127.0.0.1:{port} (Press CTRL+C" in caplog.text
    assert _FakeServer.seen["socket"].fileno() == -1  # closed once served


def test_api_servers_get_the_socket_bound_before_the_cores_start(monkeypatch, tmp_path):
    seen = {}

    def run_api_servers(args, config, blocked, listener):
        seen["address"] = listener.getsockname()
        with socket.create_connection(listener.getsockname()[:2], timeout=5):
            return 0

    monkeypatch.setattr("quire.entrypoints.cli.serve_processes.run_api_servers",
                        run_api_servers)
    monkeypatch.setattr("quire.entrypoints.cli.serve._configure_logging", lambda level: None)
    assert main(["serve", "--model", str(tmp_path), "--port", "0",
                 "--api-server-count", "2"]) == 0
    assert seen["address"][0] == "127.0.0.1" and seen["address"][1] != 0
