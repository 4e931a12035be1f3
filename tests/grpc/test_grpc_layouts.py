"""gRPC in the server's other layouts (slow: each starts several processes): two API
server processes on one gRPC port (``SO_REUSEPORT``) over two data-parallel engine
cores, gRPC only (``--no-http``); the engine in the API server's process, gRPC only;
and two models behind one API server, with a waiting
queue of one (``RESOURCE_EXHAUSTED`` with ``retry-after``) and the drain on SIGTERM
(``UNAVAILABLE`` for new calls, running ones ended, exit status 0)."""

from __future__ import annotations

import asyncio
import re
import signal
import time

import grpc
import httpx
import pytest
from grpc_client import channel, pb2, pb2_grpc, status
from grpc_health.v1 import health_pb2, health_pb2_grpc
from serve_process import ServeProcess

pytestmark = pytest.mark.slow

PROMPT = "Once upon a time"


def _text(stub, model="", **fields):
    out = {"text": "", "ids": set()}
    for m in stub.Generate(pb2.GenerateRequest(model=model, text=PROMPT, temperature=0,
                                               ignore_eos=True, **fields), timeout=60):
        out["text"] += "".join(c.text for c in m.choices)
        out["ids"].add(m.request_id)
    return out


@pytest.fixture(scope="module")
def api_servers(tiny_checkpoint):
    srv = ServeProcess("--model", str(tiny_checkpoint("llama")), "--max-model-len", "128",
                       "--no-http", "--grpc-port", "0", "--api-server-count", "2",
                       "--data-parallel-size", "2", start_timeout=240)
    deadline = time.monotonic() + 120
    while not any("2 API servers running" in line for line in srv.log):
        assert time.monotonic() < deadline and srv.proc.poll() is None, "".join(srv.log)
        time.sleep(0.1)
    yield srv
    assert srv.stop() == 0


def test_two_api_servers_serve_one_grpc_port(api_servers):
    ports = {m.group(1) for line in list(api_servers.log)
             if (m := re.search(r"gRPC running on (\S+)", line))}
    assert ports == {api_servers.grpc_address}
    assert sum("gRPC running on" in line for line in list(api_servers.log)) == 2
    assert not any("Uvicorn running" in line for line in list(api_servers.log))  # no HTTP


def test_calls_spread_over_both_api_servers_all_equal(api_servers):
    """16 connections: the kernel spreads them over the two servers (each names its
    requests with its own prefix); every greedy answer is the same."""
    answers = []
    for _ in range(16):
        with channel(api_servers.grpc_address) as ch:
            answers.append(_text(pb2_grpc.GenerationStub(ch), max_tokens=8))
            health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
            assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert len({a["text"] for a in answers}) == 1
    prefixes = {rid.rsplit("-", 1)[0] for a in answers for rid in a["ids"]}
    assert len(prefixes) == 2


def test_engine_in_process_grpc_only(tiny_checkpoint):
    """One process: the engine in the API server, no HTTP port; greedy text equals the
    offline engine's, and the process stops cleanly."""
    from quire import LLM, SamplingParams

    path = str(tiny_checkpoint("llama"))
    srv = ServeProcess("--model", path, "--max-model-len", "128", "--engine-in-process",
                       "--no-http", "--grpc-port", "0")
    try:
        assert set(srv.descendants().values()) <= {"other"}  # no core process
        with channel(srv.grpc_address) as ch:
            got = _text(pb2_grpc.GenerationStub(ch), max_tokens=8)["text"]
    finally:
        assert srv.stop() == 0
    llm = LLM(path, device="cpu", max_model_len=128)
    want = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8,
                                                 ignore_eos=True))[0].outputs[0].text
    assert got == want


@pytest.fixture(scope="module")
def two_models(tiny_checkpoint):
    path = str(tiny_checkpoint("llama"))
    srv = ServeProcess("--model", path, "--model", path, "--served-model-name", "a", "b",
                       "--kv-cache-memory", "16MiB", "--max-model-len", "128",
                       "--grpc-port", "0", "--max-waiting-requests", "1",
                       "--shutdown-timeout", "1", start_timeout=240)
    yield srv
    srv.stop()


def test_each_call_goes_to_the_model_it_names(two_models):
    with channel(two_models.grpc_address) as ch:
        stub = pb2_grpc.GenerationStub(ch)
        for model in ("a", "b"):
            want = httpx.post(two_models.url + "/v1/completions", timeout=30, json={
                "model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                "ignore_eos": True}).json()["choices"][0]["text"]
            assert _text(stub, model, max_tokens=6)["text"] == want
        code, details, _ = status(lambda: stub.Tokenize(pb2.TokenizeRequest(prompt="x")))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "model is required" in details
        models = stub.ListModels(pb2.ListModelsRequest()).models
        assert [m.id for m in models] == ["a", "b"]


def test_overloaded_is_resource_exhausted_with_retry_after(two_models):
    async def run() -> list[tuple[grpc.StatusCode, dict[str, str]]]:
        async with channel(two_models.grpc_address, aio=True) as ch:
            stub = pb2_grpc.GenerationStub(ch)

            async def one() -> tuple[grpc.StatusCode, dict[str, str]]:
                call = stub.Generate(pb2.GenerateRequest(model="a", text=PROMPT,
                                                         max_tokens=32, ignore_eos=True))
                try:
                    async for _ in call:
                        pass
                except grpc.aio.AioRpcError as exc:
                    return exc.code(), dict(exc.trailing_metadata() or ())
                return grpc.StatusCode.OK, {}

            return await asyncio.gather(*(one() for _ in range(24)))

    results = asyncio.run(run())
    codes = {code for code, _ in results}
    assert codes == {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
    for code, meta in results:
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            assert meta["retry-after"] == "1"
    two_models.wait_idle()


def test_zz_drain_on_sigterm_refuses_new_calls_and_ends_running_ones(two_models):
    with channel(two_models.grpc_address) as ch:
        stub = pb2_grpc.GenerationStub(ch)
        running = stub.Generate(pb2.GenerateRequest(model="a", text=PROMPT, n=32,
                                                    max_tokens=120, ignore_eos=True))
        assert next(running).choices
        two_models.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        code, _, _ = status(lambda: stub.Tokenize(pb2.TokenizeRequest(model="a",
                                                                      prompt="x"),
                                                  timeout=5))
        assert code == grpc.StatusCode.UNAVAILABLE
        reasons = {c.finish_reason for m in running for c in m.choices if c.finish_reason}
        assert reasons <= {"abort", "length"} and reasons
    assert two_models.proc.wait(timeout=60) == 0
