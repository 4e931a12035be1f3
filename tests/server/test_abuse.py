"""``quire serve`` as a real process under abuse: 100 normal streaming clients beside
clients that never read their stream, send their headers a byte a second, or send
requests at the default limits (64 stop strings of 1024 characters; prompts x n = 256
sequences). The abusive clients are ``quire bench abuse``'s (:mod:`quire.bench.abuse`).
Loopback only; every socket has a timeout and every loop a bound.

Asserted, for the abused phase:

- every normal client gets exactly the text it gets alone (greedy decoding);
- nobody gets a 5xx, and the requests at the limits are served (200);
- the server cuts every stream that is not read (it disconnects the client);
- the server's resident memory stays below its idle level + 300 MiB
  (``RSS_HEADROOM_KIB``; idle: after a warm-up round of the same clients);
- ``/health`` answers within 100 ms at the 95th percentile (``HEALTH_P95_S``), probed
  from a process of its own so that this process's load does not count;
- afterwards nothing is running or waiting and no KV page is held.

A connection that sends its headers a byte a second is closed within the header timeout
(``ServerLimits.header_timeout_s``, 30 s) plus 15 s.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from quire.bench.abuse import AbuseMix, Abusers
from serve_process import ServeProcess, greedy_reference

pytestmark = pytest.mark.slow

MODEL = "tiny"
NUM_CLIENTS = 100
RSS_HEADROOM_KIB = 300 * 1024
HEALTH_P95_S = 0.100
#: Seconds the abused round may take in all; a hang fails instead of blocking CI.
ROUND_TIMEOUT_S = 300.0
HEADER_TIMEOUT_S = 30.0
MIX = AbuseMix(non_readers=4, slow_headers=16, max_stop_clients=2, max_fanout_clients=2,
               slow_interval_s=1.0, head_start_s=1.0)

# Polls /health on one kept-alive connection until the stop file appears (or a bound);
# prints the latencies in seconds (null for a failure) as JSON.
HEALTH_PROBE = r"""
import http.client, json, os, sys, time
host, port, stop_file, bound = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
seen, conn, end = [], None, time.monotonic() + bound
while time.monotonic() < end and not os.path.exists(stop_file):
    start = time.perf_counter()
    try:
        conn = conn or http.client.HTTPConnection(host, port, timeout=5)
        conn.request("GET", "/health")
        conn.getresponse().read()
        seen.append(time.perf_counter() - start)
    except OSError:
        seen.append(None)
        conn = None
    time.sleep(0.05)
print(json.dumps(seen))
"""


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    # a waiting bound no run here reaches: a 503 could only be a bug
    srv = ServeProcess("--model", str(tiny_checkpoint("llama")), "--served-model-name", MODEL,
                       "--max-waiting-requests", "100000", "--max-num-seqs", "64")
    yield srv
    rc = srv.stop()
    log = "".join(srv.log)
    assert rc == 0, log[-3000:]
    assert "Traceback" not in log, log[log.index("Traceback") - 200:][:4000]


def _jobs() -> list[tuple[str, int]]:
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while",
             "seven", "owls", "watch"]
    rng = random.Random(2)
    prompts = [" ".join(rng.choice(words) for _ in range(n)) for n in (3, 8, 16, 30)]
    return [(rng.choice(prompts), rng.choice((4, 12, 24))) for _ in range(NUM_CLIENTS)]


async def _stream_one(client: httpx.AsyncClient, url: str, prompt: str,
                      max_tokens: int) -> tuple[int, str]:
    """(status, text) of one streamed greedy completion; the body for a non-200."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return r.status_code, (await r.aread()).decode(errors="replace")
        text, done = [], False
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                assert "error" not in event, event
                text.append(event["choices"][0]["text"])
        assert done, "a stream ended without [DONE]"
        return 200, "".join(text)


async def _round(url: str, jobs: list[tuple[str, int]],
                 mix: AbuseMix | None) -> tuple[list[tuple[int, str]], dict]:
    """The normal clients at once, beside ``mix``'s abusers (if any); their results and
    what the abusers got."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        abusers = task = None
        if mix is not None:
            abusers = Abusers(client, url, MODEL, None, mix)
            task = asyncio.ensure_future(abusers.run())
            await asyncio.sleep(mix.head_start_s)
        try:
            results = await asyncio.gather(*(_stream_one(client, url, p, n) for p, n in jobs))
        finally:
            if abusers is not None and task is not None:
                abusers.stop()
                await asyncio.wait_for(task, 60)
        return list(results), abusers.figures() if abusers else {}


class PeakRss:
    """The server's highest VmRSS, sampled every 0.1 s while inside ``with``."""

    def __init__(self, server: ServeProcess) -> None:
        self.server, self.peak_kib = server, 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._done.wait(0.1):
            self.peak_kib = max(self.peak_kib, self.server.rss_kib())

    def __enter__(self) -> PeakRss:  # noqa: PYI034 - final in effect
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(timeout=5)


class HealthProbe:
    """``HEALTH_PROBE`` in a child process while inside ``with``; ``latencies`` after."""

    def __init__(self, url: str, tmp_path: Path) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.stop_file = tmp_path / "stop-health-probe"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HEALTH_PROBE, host, port, str(self.stop_file),
             str(ROUND_TIMEOUT_S)], stdout=subprocess.PIPE, text=True)
        self.latencies: list[float | None] = []

    def __enter__(self) -> HealthProbe:  # noqa: PYI034 - final in effect
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_file.touch()
        out, _ = self.proc.communicate(timeout=30)
        self.latencies = json.loads(out)


def test_normal_clients_are_served_beside_abusive_ones(server, tmp_path):
    jobs = _jobs()
    reference = greedy_reference(server.url, set(jobs), MODEL)
    warm, _ = asyncio.run(_round(server.url, jobs, None))  # allocator and caches settle
    assert all(status == 200 for status, _ in warm), warm
    server.wait_idle()
    idle_kib = server.rss_kib()

    with PeakRss(server) as rss, HealthProbe(server.url, tmp_path) as health:
        start = time.monotonic()
        results, outcomes = asyncio.run(asyncio.wait_for(
            _round(server.url, jobs, MIX), ROUND_TIMEOUT_S))
        elapsed = time.monotonic() - start
    server.wait_idle(timeout=60)

    served = sorted(x for x in health.latencies if x is not None)
    p95 = served[int(0.95 * (len(served) - 1))] if served else float("inf")
    print(f"\nabuse: {NUM_CLIENTS} clients in {elapsed:.1f}s; abusers {outcomes}; RSS idle "
          f"{idle_kib // 1024} MiB, peak {rss.peak_kib // 1024} MiB; /health p95 "
          f"{p95 * 1000:.0f} ms, max {max(served, default=0) * 1000:.0f} ms, "
          f"{health.latencies.count(None)} failed")
    wrong = [(job, r) for job, r in zip(jobs, results) if r != (200, reference[job])]
    assert not wrong, wrong[:5]
    for kind in ("max_stop", "max_fanout"):
        assert outcomes[kind] and set(outcomes[kind]) == {"200"}, (kind, outcomes[kind])
    assert not any(k.startswith("5") for counts in outcomes.values() for k in counts)
    assert outcomes["non_reader"] == {"cut": MIX.non_readers}, outcomes["non_reader"]
    assert rss.peak_kib <= idle_kib + RSS_HEADROOM_KIB, (idle_kib, rss.peak_kib)
    assert health.latencies.count(None) == 0 and p95 < HEALTH_P95_S, p95
    assert server.metric("quire:num_requests_running") == 0
    assert server.metric("quire:num_requests_waiting") == 0


def test_headers_sent_a_byte_a_second_are_cut(server):
    mix = AbuseMix(non_readers=0, slow_headers=2, max_stop_clients=0, max_fanout_clients=0,
                   slow_interval_s=1.0)

    async def run() -> dict:
        async with httpx.AsyncClient(timeout=30) as client:
            abusers = Abusers(client, server.url, MODEL, None, mix)
            task = asyncio.ensure_future(abusers.run())
            deadline = time.monotonic() + HEADER_TIMEOUT_S + 15
            while time.monotonic() < deadline and \
                    sum(abusers.outcomes["slow_header"].values()) < mix.slow_headers:
                await asyncio.sleep(0.5)
            abusers.stop()
            await asyncio.wait_for(task, 30)
            return abusers.figures()

    outcomes = asyncio.run(run())
    assert outcomes["slow_header"] == {"cut": mix.slow_headers}, outcomes
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
