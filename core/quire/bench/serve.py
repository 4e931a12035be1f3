"""Load against a running OpenAI-compatible server: streaming ``/v1/completions``.

Prompts are sent as text, not token ids, because another server may tokenize
differently; the text is what our tokenizer makes exactly N tokens of, and the
server's own count is recorded when it returns ``usage``. Requests go out either from
``concurrency`` clients, each sending its next request when the last one ends, or at
Poisson arrivals of ``request_rate`` per second (seeded, so the schedule repeats).

Each content chunk of the stream counts as one token arrival: TTFT is the wait for the
first one, ITL the gaps between the next ones. A server that packs several tokens into
one chunk therefore shows fewer, longer gaps.

Requests may go to several targets (servers, or models of one server): the ``i``-th to
target ``i mod n`` (``alternate``), or the first half to the first target and the rest
to the second (``halves``: traffic that shifts from one model to the other).

Around each pass the server's ``/metrics`` is read for speculative decoding's counters
(``quire:spec_decode_*`` or vLLM's ``vllm:spec_decode_*``, summed over its engines), so
a speculating server's acceptance figures come with its timings; a server without them
gives none.

With ``grpc_address`` the requests go over ``quire serve``'s gRPC API instead
(:mod:`quire.bench.serve_grpc`); ``/metrics`` is still read at the HTTP url.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from quire.bench.peers.clock import TokenClock
from quire.bench.stats import SLO, SpecCounts, distribution, goodput, spec_figures
from quire.bench.workloads import BenchRequest

#: HTTP status a server sends when it sheds load; counted apart from other errors.
OVERLOADED = 503


@dataclass(frozen=True)
class LoadShape:
    """How requests are sent: by a fixed number of clients, or at a Poisson rate."""

    concurrency: int | None = None
    request_rate: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.request_rate is None):
            raise ValueError("give exactly one of concurrency and request_rate")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.request_rate is not None and not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 per second, got {self.request_rate}")

    def arrival_offsets(self, n: int) -> list[float]:
        """Send times of ``n`` requests in seconds from the start (Poisson mode)."""
        assert self.request_rate is not None
        rng = random.Random(self.seed)
        offsets, now = [], 0.0
        for _ in range(n):
            offsets.append(now)
            now += rng.expovariate(self.request_rate)
        return offsets


@dataclass
class RequestResult:
    """One request's outcome; timings are None unless it succeeded."""

    ok: bool
    status: int | None = None
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    chunks: int = 0
    #: Prompt tokens by our tokenizer (what the text was cut to).
    expected_prompt_tokens: int | None = None
    #: The server's counts from ``usage``, when it sent them.
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


@dataclass
class ServeRun:
    """Every request of one pass, and its wall time."""

    results: list[RequestResult]
    duration_s: float
    #: The server's speculative decoding counters before and after the pass (None when
    #: its /metrics has none).
    spec: tuple[SpecCounts, SpecCounts] | None = None

    def figures(self, slo: SLO) -> dict[str, float]:
        ok = [r for r in self.results if r.ok]
        overloaded = sum(1 for r in self.results if r.status == OVERLOADED)
        figures: dict[str, float] = {
            "completed": len(ok), "overloaded_503": overloaded,
            "errors": len(self.results) - len(ok) - overloaded,
            "duration_s": self.duration_s,
            "requests_per_s": len(ok) / self.duration_s,
            "output_tokens_per_s": sum(_output_tokens(r) for r in ok) / self.duration_s,
        }
        samples = [(r.ttft_s, r.e2e_s) for r in ok
                   if r.ttft_s is not None and r.e2e_s is not None]
        figures.update(distribution("ttft_s", [ttft for ttft, _ in samples]))
        figures.update(distribution("itl_s", [g for r in ok for g in r.itl_s]))
        figures.update(distribution("e2e_s", [e2e for _, e2e in samples]))
        if slo.is_set:
            figures["goodput_requests_per_s"] = goodput(samples, self.duration_s, slo)
        counted = [r for r in ok if r.prompt_tokens is not None]
        if counted:  # another tokenizer may count the same text differently
            same = sum(1 for r in counted if r.prompt_tokens == r.expected_prompt_tokens)
            figures["usage_prompt_match"] = same / len(counted)
        if self.spec is not None:
            figures.update(spec_figures(*self.spec))
        return figures


def _output_tokens(result: RequestResult) -> int:
    return result.completion_tokens if result.completion_tokens is not None else result.chunks


def completion_body(model: str, request: BenchRequest) -> dict[str, Any]:
    """A streaming, greedy ``/v1/completions`` body making exactly ``output_len`` tokens."""
    return {"model": model, "prompt": request.prompt.text, "max_tokens": request.output_len,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}


def sse_events(lines: list[str]) -> Iterator[dict[str, Any]]:
    """The JSON payloads of server-sent-event ``data:`` lines, up to ``[DONE]``."""
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def finish(result: RequestResult, clock: TokenClock, start: float) -> RequestResult:
    """``result`` once its stream ended without an error: timed by ``clock`` (its token
    arrivals) from ``start``, or failed when no arrival carried text. Every transport's
    client ends with it, so they time alike."""
    if clock.first is None:
        result.error = "the stream carried no text"
        return result
    timing = clock.timing()
    result.ok, result.ttft_s, result.itl_s = True, timing["ttft_s"], timing["itl_s"]
    result.e2e_s = time.perf_counter() - start
    return result


class Client:
    """Sends the workload to ``url`` with one ``httpx.AsyncClient``."""

    def __init__(self, http: Any, url: str, model: str, api_key: str | None) -> None:
        self.http = http
        self.endpoint = url.rstrip("/") + "/v1/completions"
        self.model = model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def send(self, request: BenchRequest) -> RequestResult:
        """One streamed request, timed; never raises for a failed request."""
        import httpx

        start = time.perf_counter()
        clock = TokenClock(start)
        result = RequestResult(ok=False, expected_prompt_tokens=request.prompt_len)
        try:
            async with self.http.stream("POST", self.endpoint, headers=self.headers,
                                        json=completion_body(self.model, request)) as resp:
                result.status = resp.status_code
                if resp.status_code != 200:
                    result.error = (await resp.aread()).decode(errors="replace")[:200]
                    return result
                async for line in resp.aiter_lines():
                    self._read_event(line, clock, result)
        except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
            result.error = f"{type(exc).__name__}: {exc}"
            return result
        return finish(result, clock, start)

    @staticmethod
    def _read_event(line: str, clock: TokenClock, result: RequestResult) -> None:
        for event in sse_events([line]):
            usage = event.get("usage")
            if usage:
                result.prompt_tokens = usage.get("prompt_tokens")
                result.completion_tokens = usage.get("completion_tokens")
            choices = event.get("choices") or []
            if choices and choices[0].get("text"):
                result.chunks += 1
                clock.observe(result.chunks)


#: How requests are spread over several targets (module docstring).
SPLITS = ("alternate", "halves")


def target_of(i: int, num_requests: int, num_targets: int, split: str = "alternate") -> int:
    """The target of request ``i`` of ``num_requests``."""
    if split == "halves":
        return min(num_targets - 1, i * num_targets // num_requests)
    return i % num_targets


async def run_load(client: Client | list[Client], requests: list[BenchRequest],
                   shape: LoadShape, split: str = "alternate") -> ServeRun:
    """Send every request as ``shape`` says, to the client ``split`` picks from a list;
    results in request order."""
    clients = client if isinstance(client, list) else [client]
    routed = [clients[target_of(i, len(requests), len(clients), split)]
              for i in range(len(requests))]
    results: list[RequestResult | None] = [None] * len(requests)
    start = time.perf_counter()
    if shape.concurrency is not None:
        queue = iter(enumerate(requests))

        async def worker() -> None:
            for i, request in queue:  # the shared iterator hands each request out once
                results[i] = await routed[i].send(request)

        await asyncio.gather(*(worker() for _ in range(min(shape.concurrency, len(requests)))))
    else:
        async def at(offset: float, i: int) -> None:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            results[i] = await routed[i].send(requests[i])

        offsets = shape.arrival_offsets(len(requests))
        await asyncio.gather(*(at(off, i) for i, off in enumerate(offsets)))
    duration = time.perf_counter() - start
    return ServeRun([r for r in results if r is not None], duration)


async def first_model(http: Any, url: str, api_key: str | None) -> str:
    """The first model ``GET /v1/models`` lists. :raises RuntimeError: when none."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    resp = await http.get(url.rstrip("/") + "/v1/models", headers=headers)
    resp.raise_for_status()
    models = resp.json().get("data") or []
    if not models:
        raise RuntimeError(f"{url}/v1/models lists no model; pass --served-model-name")
    return str(models[0]["id"])


#: Speculative decoding's counters in /metrics, by the name after the server's prefix
#: (prometheus_client writes a counter's samples with ``_total``).
_SPEC_COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                  "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_per_pos")
_SAMPLE = re.compile(r'(?:quire|vllm):(spec_decode_[a-z_]+?)(?:_total)?(\{[^}]*\})? (\S+)$')
_POSITION = re.compile(r'position="(\d+)"')


def spec_counts(metrics_text: str) -> SpecCounts | None:
    """Speculative decoding's counters in a Prometheus text exposition, summed over
    engines; None when it has none."""
    totals = dict.fromkeys(_SPEC_COUNTERS[:3], 0.0)
    per_pos: dict[int, float] = {}
    found = False
    for line in metrics_text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or match.group(1) not in _SPEC_COUNTERS:
            continue
        found = True
        name, value = match.group(1), float(match.group(3))
        if name == _SPEC_COUNTERS[3]:
            pos = _POSITION.search(match.group(2) or "")
            if pos is not None:
                per_pos[int(pos.group(1))] = per_pos.get(int(pos.group(1)), 0.0) + value
        else:
            totals[name] += value
    if not found:
        return None
    return SpecCounts(*(int(totals[n]) for n in _SPEC_COUNTERS[:3]),
                      tuple(int(per_pos.get(i, 0)) for i in range(max(per_pos, default=-1)
                                                                   + 1)))


async def read_spec_counts(http: Any, url: str, api_key: str | None) -> SpecCounts | None:
    """The server's speculative decoding counters, or None (no /metrics, or none in
    it)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = await http.get(url.rstrip("/") + "/metrics", headers=headers)
    except (OSError, httpx.HTTPError):  # unreachable: the pass reports it per request
        return None
    if resp.status_code != 200:
        return None
    return spec_counts(resp.text)


def run(url: str | list[tuple[str, str | None]], runs: list[list[BenchRequest]],
        shape: LoadShape, model: str | None, api_key: str | None, timeout_s: float,
        split: str = "alternate", grpc_address: str | None = None
        ) -> tuple[str, list[ServeRun]]:
    """Each pass in ``runs`` one after the other, against ``url``, or against several
    (url, model) targets spread as ``split`` says (``model`` then unused; a None model
    is the first its server lists); with ``grpc_address`` (``host:port``), over gRPC.

    :returns: the model name used (names, joined), and one :class:`ServeRun` per pass.
    """
    import httpx

    targets = [(url, model)] if isinstance(url, str) else url
    one_server = len({u for u, _ in targets}) == 1
    first_url = targets[0][0]

    async def main() -> tuple[str, list[ServeRun]]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with contextlib.AsyncExitStack() as stack:
            http = await stack.enter_async_context(httpx.AsyncClient(
                timeout=httpx.Timeout(timeout_s), limits=limits))
            if grpc_address is None:
                clients: list[Any] = [
                    Client(http, u, m or await first_model(http, u, api_key), api_key)
                    for u, m in targets]
            else:
                clients = await _grpc_clients(stack, grpc_address, targets, api_key,
                                              timeout_s)
            name = ", ".join(c.model for c in clients)
            passes = []
            for requests in runs:
                # speculative decoding's counters, where one server answers them all
                before = await read_spec_counts(http, first_url, api_key) \
                    if one_server else None
                result = await run_load(clients, requests, shape, split)
                after = await read_spec_counts(http, first_url, api_key) \
                    if before is not None else None
                if before is not None and after is not None:
                    result.spec = (before, after)
                passes.append(result)
            return name, passes

    return asyncio.run(main())


async def _grpc_clients(stack: contextlib.AsyncExitStack, address: str,
                        targets: list[tuple[str, str | None]], api_key: str | None,
                        timeout_s: float) -> list[Any]:
    """One gRPC client per target model, all on one channel to ``address``."""
    import grpc

    from quire.bench.serve_grpc import GrpcClient
    from quire.bench.serve_grpc import first_model as grpc_first_model

    channel = await stack.enter_async_context(grpc.aio.insecure_channel(address))
    return [GrpcClient(channel, m or await grpc_first_model(channel, api_key), api_key,
                       timeout_s) for _, m in targets]
