"""What abusive clients cost the normal ones: ``quire bench abuse``.

The same number of normal streaming clients (:class:`quire.bench.serve.Client`, one
greedy request each) run twice against one server: alone, then beside the abusive
clients of an :class:`AbuseMix`:

- *non-readers*: raw sockets (4 KiB receive buffer) that send a streaming request of the
  most sequences, with logprobs, and never read the answer;
- *slow headers*: connections that send their request headers one byte at a time;
- *limit requests*: one after another, requests at the server's default limits: 64 stop
  strings of 1024 characters, or prompts x n = 256 sequences.

Each phase yields :meth:`ServeRun.figures` (TTFT and end-to-end percentiles ...) and,
when the server's process id is known, its peak resident memory; every abusive client
counts what it got (HTTP statuses; "cut" when the server closed the connection).
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from quire.bench.peers.procmem import peak_rss_bytes, reset_peak_rss
from quire.bench.report import Figure
from quire.bench.serve import Client, LoadShape, ServeRun, first_model, run_load
from quire.bench.stats import SLO
from quire.bench.workloads import BenchRequest

#: What the table shows of each phase.
ABUSE_FIGURES = (
    Figure("completed", "completed"),
    Figure("overloaded_503", "HTTP 503"),
    Figure("errors", "other errors"),
    Figure("ttft_s_p50", "TTFT p50 (ms)", 1000.0),
    Figure("ttft_s_p95", "TTFT p95 (ms)", 1000.0),
    Figure("e2e_s_p50", "end-to-end p50 (ms)", 1000.0),
    Figure("e2e_s_p95", "end-to-end p95 (ms)", 1000.0),
    Figure("output_tokens_per_s", "output tokens/s"),
    Figure("peak_rss_mib", "server peak RSS (MiB)"),
    Figure("duration_s", "duration (s)"),
)
#: Seconds to connect, or to send one request, on a raw socket.
SOCKET_TIMEOUT_S = 10.0
#: At the end of a phase, how long a non-reader reads what is left, and at most how much.
DRAIN_S = 5.0
DRAIN_BYTES = 64 * 2**20
PROMPTS = ("Once upon a time", "The capital of France", "In a quiet village by the sea",
           "Attention is all you need")


@dataclass(frozen=True)
class AbuseMix:
    """How many abusive clients of each kind, and the server limits they sit at."""

    non_readers: int = 4
    slow_headers: int = 8
    #: Clients sending requests with the most stop strings, each of the longest.
    max_stop_clients: int = 2
    #: Clients sending requests of the most sequences (prompts x n).
    max_fanout_clients: int = 2
    #: Seconds between two header bytes of a slow-header client.
    slow_interval_s: float = 1.0
    #: Seconds the abusers run before the normal clients start.
    head_start_s: float = 1.0
    #: Seconds the abusers' requests still in flight when the normal clients are done may
    #: take to finish (counted then), and a non-reader goes on not reading: with fair
    #: admission their sequences run after the normal clients'.
    grace_s: float = 30.0
    stop_strings: int = 64
    stop_string_chars: int = 1024
    sequences: int = 256
    #: Tokens per sequence of the limit requests, and of the non-readers' streams.
    max_tokens: int = 4
    non_reader_tokens: int = 64

    def __post_init__(self) -> None:
        for name in ("non_readers", "slow_headers", "max_stop_clients",
                     "max_fanout_clients"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("stop_strings", "stop_string_chars", "sequences", "max_tokens",
                     "non_reader_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.slow_interval_s > 0 or self.head_start_s < 0 or self.grace_s < 0:
            raise ValueError("slow_interval_s must be > 0, head_start_s and grace_s >= 0")

    def stop_body(self, model: str, i: int) -> dict[str, Any]:
        """Every stop string distinct and never matched; streamed every other time."""
        pad = "~" * (self.stop_string_chars - 6)
        stops = [f"{i % 100:02d}{k:04d}{pad}" for k in range(self.stop_strings)]
        return {"model": model, "prompt": PROMPTS[i % len(PROMPTS)], "stop": stops,
                "max_tokens": self.max_tokens, "temperature": 0, "stream": i % 2 == 1}

    def fanout_body(self, model: str, i: int, *, stream: bool = False,
                    max_tokens: int | None = None) -> dict[str, Any]:
        """``sequences`` sequences: as many prompts as divide it evenly, times n."""
        prompts = next(p for p in (16, 8, 4, 2, 1) if self.sequences % p == 0)
        body = {"model": model, "prompt": [f"{PROMPTS[k % len(PROMPTS)]} {k}"
                                           for k in range(prompts)],
                "n": self.sequences // prompts, "temperature": 1.0, "seed": i,
                "max_tokens": max_tokens or self.max_tokens, "ignore_eos": True}
        if stream:
            body.update(stream=True, logprobs=5)  # logprobs: many bytes per token
        return body


class Abusers:
    """The abusive clients of one phase: :meth:`run` them until :meth:`stop`.

    ``outcomes[kind]`` counts what each request or connection got: an HTTP status
    ("200", "400" ...), "cut" (the server closed the connection), "finished" (a
    non-reader's stream ended), "open" (still open at the end), or an error's name.
    """

    KINDS = ("non_reader", "slow_header", "max_stop", "max_fanout")

    def __init__(self, http: Any, url: str, model: str, api_key: str | None,
                 mix: AbuseMix) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.http = http
        self.endpoint = url.rstrip("/") + "/v1/completions"
        self.model = model
        self.auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.mix = mix
        self.outcomes: dict[str, Counter[str]] = {kind: Counter() for kind in self.KINDS}
        self._stopped = asyncio.Event()

    def stop(self) -> None:
        self._stopped.set()

    async def run(self) -> None:
        mix = self.mix
        tasks = [*(self._non_reader(i) for i in range(mix.non_readers)),
                 *(self._slow_header() for _ in range(mix.slow_headers)),
                 *(self._limit_client("max_stop", mix.stop_body)
                   for _ in range(mix.max_stop_clients)),
                 *(self._limit_client("max_fanout", mix.fanout_body)
                   for _ in range(mix.max_fanout_clients))]
        await asyncio.gather(*tasks)

    def figures(self) -> dict[str, dict[str, int]]:
        return {kind: dict(sorted(counts.items())) for kind, counts in self.outcomes.items()}

    # -- the clients ---------------------------------------------------------------------
    async def _non_reader(self, i: int) -> None:
        body = json.dumps(self.mix.fanout_body(self.model, i, stream=True,
                                               max_tokens=self.mix.non_reader_tokens))
        request = self._head(len(body.encode())) + body.encode()
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        try:
            await asyncio.wait_for(loop.sock_connect(sock, (self.host, self.port)),
                                   SOCKET_TIMEOUT_S)
            await asyncio.wait_for(loop.sock_sendall(sock, request), SOCKET_TIMEOUT_S)
            await self._stopped.wait()
            await asyncio.sleep(self.mix.grace_s)  # still not reading
            outcome = await _drain(loop, sock)
        except (OSError, asyncio.TimeoutError) as exc:
            outcome = type(exc).__name__
        finally:
            sock.close()
        self.outcomes["non_reader"][outcome] += 1

    async def _slow_header(self) -> None:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(self.host, self.port), SOCKET_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError) as exc:
            self.outcomes["slow_header"][type(exc).__name__] += 1
            return
        closed = asyncio.ensure_future(reader.read())  # returns when the server closes
        text = self._head(10)[:-2] + b"X-Slow: " + b"a" * 100_000
        outcome = "open"
        try:
            for byte in text:
                if closed.done():
                    outcome = "cut"
                    break
                writer.write(bytes([byte]))
                await writer.drain()
                if await _wait(self._stopped, self.mix.slow_interval_s):
                    break
        except OSError:
            outcome = "cut"
        finally:
            closed.cancel()
            writer.close()
        self.outcomes["slow_header"][outcome] += 1

    async def _limit_client(self, kind: str, body_of: Any) -> None:
        i = 0
        while not self._stopped.is_set():
            request = asyncio.ensure_future(self._send(body_of(self.model, i)))
            stop = asyncio.ensure_future(self._stopped.wait())
            await asyncio.wait([request, stop], return_when=asyncio.FIRST_COMPLETED)
            stop.cancel()
            if not request.done():  # the phase ended first: a grace period to finish
                await asyncio.wait([request], timeout=self.mix.grace_s)
            if not request.done():
                request.cancel()
                self.outcomes[kind]["unfinished"] += 1
                return
            self.outcomes[kind][request.result()] += 1
            i += 1

    async def _send(self, body: dict[str, Any]) -> str:
        import httpx

        try:
            async with self.http.stream("POST", self.endpoint, json=body,
                                        headers=self.auth) as resp:
                async for _ in resp.aiter_bytes():
                    pass
                return str(resp.status_code)
        except httpx.HTTPError as exc:
            return type(exc).__name__

    def _head(self, length: int) -> bytes:
        lines = ["POST /v1/completions HTTP/1.1", f"Host: {self.host}:{self.port}",
                 "Content-Type: application/json", f"Content-Length: {length}",
                 *(f"{k}: {v}" for k, v in self.auth.items())]
        return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def _wait(event: asyncio.Event, timeout: float) -> bool:
    """Whether ``event`` was set within ``timeout`` seconds."""
    try:
        await asyncio.wait_for(event.wait(), timeout)
    except asyncio.TimeoutError:
        return False
    return True


async def _drain(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> str:
    """Read what a non-reader was sent, for a bounded time: "cut" when the server had
    closed the connection, "finished" when the stream ended, else "open"."""
    deadline = time.monotonic() + DRAIN_S
    tail, total = b"", 0
    while total < DRAIN_BYTES:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            chunk = await asyncio.wait_for(loop.sock_recv(sock, 2**16), left)
        except asyncio.TimeoutError:
            break
        except ConnectionError:
            return "cut"
        if not chunk:
            return "cut"
        total += len(chunk)
        tail = (tail + chunk)[-64:]
        if b"data: [DONE]" in tail:
            return "finished"
    return "open"


# -- memory ------------------------------------------------------------------------------
class PeakMemory:
    """The peak resident memory of process ``pid`` from :meth:`start` on (None: unknown)."""

    def __init__(self, pid: int | None) -> None:
        self.pid = pid

    def start(self) -> None:
        if self.pid is not None:
            reset_peak_rss(self.pid, include_children=False)

    def peak_mib(self) -> float | None:
        if self.pid is None:
            return None
        peak = peak_rss_bytes(self.pid, include_children=False)
        return None if peak is None else peak / float(1 << 20)


# -- the two phases ----------------------------------------------------------------------
@dataclass
class AbuseResult:
    """The normal clients' runs alone and beside the abusers, and what the abusers got."""

    model: str
    alone: ServeRun
    abused: ServeRun
    outcomes: dict[str, dict[str, int]]
    peak_rss_mib: dict[str, float | None]

    def figures(self, phase: str) -> dict[str, float]:
        figures = getattr(self, phase).figures(SLO())
        peak = self.peak_rss_mib[phase]
        if peak is not None:
            figures["peak_rss_mib"] = peak
        return figures


async def _phase(client: Client, requests: list[BenchRequest], memory: PeakMemory,
                 abusers: Abusers | None) -> tuple[ServeRun, float | None]:
    memory.start()
    task = None
    if abusers is not None:
        task = asyncio.ensure_future(abusers.run())
        await asyncio.sleep(abusers.mix.head_start_s)
    try:
        run = await run_load(client, requests, LoadShape(concurrency=len(requests)))
    finally:
        if task is not None and abusers is not None:
            abusers.stop()
            await task
    return run, memory.peak_mib()


def run(url: str, passes: list[list[BenchRequest]], mix: AbuseMix, model: str | None,
        api_key: str | None, timeout_s: float, pid: int | None) -> AbuseResult:
    """Every pass but the last two untimed (warm-up), then the second last alone and the
    last beside the abusers; one normal client per request."""
    import httpx

    if len(passes) < 2:
        raise ValueError("give at least two passes: alone, then abused")

    async def main() -> AbuseResult:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as http:
            name = model or await first_model(http, url, api_key)
            client = Client(http, url, name, api_key)
            memory = PeakMemory(pid)
            for requests in passes[:-2]:
                await run_load(client, requests, LoadShape(concurrency=len(requests)))
            alone, alone_peak = await _phase(client, passes[-2], memory, None)
            abusers = Abusers(http, url, name, api_key, mix)
            abused, abused_peak = await _phase(client, passes[-1], memory, abusers)
            return AbuseResult(name, alone, abused, abusers.figures(),
                               {"alone": alone_peak, "abused": abused_peak})

    return asyncio.run(main())


# -- a server of our own -----------------------------------------------------------------
class ServeChild:
    """``quire serve`` on a free port in a child process, for the length of a ``with``."""

    def __init__(self, args: list[str], start_timeout_s: float = 600.0) -> None:
        self.cmd = [sys.executable, "-m", "quire.entrypoints.cli", "serve", "--port", "0",
                    "--log-level", "info", *args]
        self.start_timeout_s = start_timeout_s
        self.log: list[str] = []
        self.url = ""
        self.proc: subprocess.Popen[str] | None = None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def __enter__(self) -> ServeChild:  # noqa: PYI034 - final in effect
        self.proc = subprocess.Popen(self.cmd, stderr=subprocess.PIPE, text=True)
        assert self.proc.stderr is not None
        deadline = time.monotonic() + self.start_timeout_s
        while not self.url:
            line = self.proc.stderr.readline()
            if not line and self.proc.poll() is not None:
                self.__exit__()
                raise RuntimeError("quire serve exited:\n" + "".join(self.log[-20:]))
            self.log.append(line)
            found = re.search(r"running on (http://[\w.\-]+:\d+)", line, re.IGNORECASE)
            if found:
                self.url = found.group(1)
            elif time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"quire serve did not start in {self.start_timeout_s}s")
        # keep reading its log, so the child never blocks on a full pipe
        threading.Thread(target=lambda: self.log.extend(self.proc.stderr),  # type: ignore
                         daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
