"""``quire bench serve --transport grpc``: the same load over ``quire serve``'s gRPC API.

:class:`GrpcClient` sends each request as one streamed ``Generate`` call (text prompt,
greedy, ``ignore_eos``, the workload's output length) and times it as the HTTP client
times its SSE stream: each message that carries text is one token arrival. All calls go
over one channel (one HTTP/2 connection, as a gRPC client usually holds); a call refused
with ``RESOURCE_EXHAUSTED`` counts as overloaded, as HTTP's 503.
"""

from __future__ import annotations

import time
from typing import Any

from quire.bench.peers.clock import TokenClock
from quire.bench.serve import OVERLOADED, RequestResult, finish
from quire.bench.workloads import BenchRequest


class GrpcClient:
    """Sends the workload as ``quire.v1.Generation/Generate`` calls on ``channel``."""

    def __init__(self, channel: Any, model: str, api_key: str | None,
                 timeout_s: float | None = None) -> None:
        from quire.entrypoints.grpc.stubs import load_stubs

        self.pb2, pb2_grpc = load_stubs()
        self.stub = pb2_grpc.GenerationStub(channel)
        self.model = model
        self.timeout_s = timeout_s
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()

    async def send(self, request: BenchRequest) -> RequestResult:
        """One streamed call, timed; never raises for a failed call."""
        import grpc

        start = time.perf_counter()
        clock = TokenClock(start)
        result = RequestResult(ok=False, expected_prompt_tokens=request.prompt_len)
        call = self.stub.Generate(self.pb2.GenerateRequest(
            model=self.model, text=request.prompt.text, max_tokens=request.output_len,
            temperature=0.0, ignore_eos=True), metadata=self.metadata, timeout=self.timeout_s)
        try:
            async for message in call:
                if message.HasField("usage"):
                    result.prompt_tokens = message.usage.prompt_tokens
                    result.completion_tokens = message.usage.completion_tokens
                if any(c.text for c in message.choices):
                    result.chunks += 1
                    clock.observe(result.chunks)
        except grpc.aio.AioRpcError as exc:
            overloaded = exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            result.status = OVERLOADED if overloaded else None
            result.error = f"{exc.code().name}: {exc.details()}"[:200]
            return result
        return finish(result, clock, start)


async def first_model(channel: Any, api_key: str | None) -> str:
    """The first model ``ListModels`` lists. :raises RuntimeError: when none."""
    client = GrpcClient(channel, "", api_key)
    answer = await client.stub.ListModels(client.pb2.ListModelsRequest(),
                                          metadata=client.metadata)
    if not answer.models:
        raise RuntimeError("ListModels lists no model; pass --served-model-name")
    return str(answer.models[0].id)
