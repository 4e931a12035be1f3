"""``quire bench serve --transport grpc``: the load over gRPC against an in-process
server (uvicorn in a thread, a ``GrpcServer`` on its loop) reports what the same load
over HTTP reports; the flags that go together are checked."""

from __future__ import annotations

import asyncio
import json

import pytest
from quire.config import EngineConfig
from quire.engine import LLMEngine
from quire.entrypoints.cli import main
from quire.entrypoints.grpc.server import GrpcOptions, GrpcServer
from quire.entrypoints.server.app import create_app
from server_thread import serve_stepped, wait_idle

ARGS = ["--num-requests", "6", "--input-len", "10", "--output-len", "5", "--repeats", "1",
        "--concurrency", "3"]


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    apps = []

    def make_app(aengine):
        apps.append(create_app(aengine, "tiny"))
        return apps[0]

    engine = LLMEngine(EngineConfig.from_kwargs(str(tiny_checkpoint("llama")), device="cpu",
                                                kv_cache_memory=4 << 20))
    srv = serve_stepped(engine, make_app)
    grpc_server = GrpcServer(apps[0].state.router, GrpcOptions("127.0.0.1", 0), None)
    port = asyncio.run_coroutine_threadsafe(grpc_server.start(), srv.engine.loop).result(30)
    srv.grpc_url = f"127.0.0.1:{port}"
    yield srv
    asyncio.run_coroutine_threadsafe(grpc_server.stop(1), srv.engine.loop).result(30)
    srv.stop()


def _median(capsys, tmp_path, server, tiny_checkpoint, *transport):
    out = tmp_path / f"result-{len(transport)}.json"
    argv = ["bench", "serve", "--url", server.url, "--model", str(tiny_checkpoint("llama")),
            *ARGS, *transport, "--output", str(out)]
    assert main(argv) == 0, capsys.readouterr().err
    result = json.loads(out.read_text())
    return result["settings"], result["results"]["server"]["median"]


def test_grpc_load_reports_as_http_does(capsys, tmp_path, server, tiny_checkpoint):
    settings, grpc_median = _median(capsys, tmp_path, server, tiny_checkpoint,
                                    "--transport", "grpc", "--grpc-url", server.grpc_url)
    _, http_median = _median(capsys, tmp_path, server, tiny_checkpoint)
    assert settings["transport"] == "grpc" and settings["model"] == "tiny"  # ListModels
    for median in (grpc_median, http_median):
        assert median["completed"] == 6 and median["errors"] == 0
        assert median["overloaded_503"] == 0 and median["usage_prompt_match"] == 1.0
        assert median["ttft_s_p99"] >= median["ttft_s_p50"] > 0
    # the same tokens: 6 requests of 5
    assert grpc_median["output_tokens_per_s"] * grpc_median["duration_s"] == \
        pytest.approx(http_median["output_tokens_per_s"] * http_median["duration_s"])
    wait_idle(server)


@pytest.mark.parametrize(("flags", "error"), [
    (["--transport", "grpc"], "--grpc-url: --transport grpc needs"),
    (["--transport", "grpc", "--grpc-url", "http://x:1"], "--grpc-url: --transport grpc"),
    (["--grpc-url", "127.0.0.1:1"], "--grpc-url: needs --transport grpc"),
])
def test_transport_flags_go_together(capsys, tiny_checkpoint, flags, error):
    rc = main(["bench", "serve", "--url", "http://127.0.0.1:9", "--model",
               str(tiny_checkpoint("llama")), *ARGS, *flags])
    assert rc == 2 and error in capsys.readouterr().err
