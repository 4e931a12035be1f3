"""`quire serve` as a real process under load: 120 concurrent streaming clients, then
SIGTERM under load. Loopback only; every wait is bounded.

The figures (requests/s, latency percentiles) are printed, not asserted: tests check
correctness (nothing lost, nothing corrupted, resources back to idle), benchmarks speed.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import time
from pathlib import Path

import httpx
import pytest
from serve_process import ServeProcess, greedy_reference

pytestmark = pytest.mark.slow

MODEL = "tiny"
NUM_CLIENTS = 120
MAX_WAITING = 100  # below the client count, so the 503 path is taken under load


@pytest.fixture(scope="module")
def tiny_model(tiny_checkpoint) -> Path:
    return tiny_checkpoint("llama")


def _prompts() -> list[str]:
    """Mixed lengths, a handful of distinct texts (so each answer can be checked)."""
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "owls", "watch"]
    rng = random.Random(0)
    return [" ".join(rng.choice(words) for _ in range(n)) for n in (2, 6, 12, 25, 45)]


async def _stream_one(client: httpx.AsyncClient, url: str, prompt: str,
                      max_tokens: int) -> tuple[int, str, float, str | None]:
    """(status, text, seconds, finish_reason) of one streamed greedy completion."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    start = time.monotonic()
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, r.text, time.monotonic() - start, None
        text, finish, done = [], None, False
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                choice = json.loads(line[6:])["choices"][0]
                text.append(choice["text"])
                finish = choice["finish_reason"] or finish
        assert done, "stream ended without [DONE]"
        return 200, "".join(text), time.monotonic() - start, finish


async def _load(url: str, jobs: list[tuple[str, int]]) -> tuple[list, float]:
    limits = httpx.Limits(max_connections=NUM_CLIENTS + 10)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        start = time.monotonic()
        results = await asyncio.gather(*(_stream_one(client, url, p, n) for p, n in jobs))
        return results, time.monotonic() - start


def test_120_concurrent_streaming_clients(tiny_model):
    server = ServeProcess("--model", str(tiny_model), "--served-model-name", MODEL,
                          "--max-waiting-requests", str(MAX_WAITING), "--max-num-seqs", "32")
    try:
        rng = random.Random(1)
        # mixed prompt and output lengths; each (prompt, length) pair is answered alone
        # first, so every answer under load can be checked against it exactly (a random
        # model's text is not a clean prefix of a longer one: incomplete UTF-8 is flushed)
        jobs = [(rng.choice(_prompts()), rng.choice((4, 12, 24))) for _ in range(NUM_CLIENTS)]
        reference = greedy_reference(server.url, set(jobs), MODEL)
        asyncio.run(_load(server.url, jobs))  # warm-up round: allocator and caches settle
        server.wait_idle()
        idle_rss = server.rss_kib()
        results, elapsed = asyncio.run(_load(server.url, jobs))
        ok = [(job, r) for job, r in zip(jobs, results) if r[0] == 200]
        refused = [r for r in results if r[0] == 503]
        assert len(ok) + len(refused) == NUM_CLIENTS, [r for r in results
                                                       if r[0] not in (200, 503)]
        for job, (_, text, _, finish) in ok:
            assert finish == "length"
            assert text == reference[job], job
        for status, body, _, _ in refused:
            assert '"overloaded"' in body
        server.wait_idle()
        rss_after = server.rss_kib()
        latencies = sorted(r[2] for _, r in ok)
        p50 = latencies[len(latencies) // 2]
        p95 = latencies[min(len(latencies) - 1, int(0.95 * len(latencies)))]
        print(f"\nload: {NUM_CLIENTS} clients, {len(ok)} completed, {len(refused)} got 503, "
              f"{len(ok) / elapsed:.1f} req/s, p50 {p50:.2f}s p95 {p95:.2f}s, "
              f"RSS idle {idle_rss // 1024} MiB after {rss_after // 1024} MiB")
        # memory back to its idle level: a leak per request would show after 120 of them
        assert rss_after <= idle_rss * 1.10 + 16 * 1024, (idle_rss, rss_after)
        assert server.metric("quire:kv_cache_usage_perc") == 0.0
        # and the server still answers
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    finally:
        rc = server.stop()
    assert rc == 0, "".join(server.log[-30:])


def test_sigterm_under_load_exits_cleanly(tiny_model):
    # no grace period: the drain aborts at once, so the streams still running must end
    # with "abort" (with 0.5 s, 16 x 250 tokens of the tiny model could all finish first)
    server = ServeProcess("--model", str(tiny_model), "--served-model-name", MODEL,
                          "--shutdown-timeout", "0")

    async def run() -> list:
        async with httpx.AsyncClient(timeout=120) as client:
            tasks = [asyncio.ensure_future(_stream_one(client, server.url, "once upon a time",
                                                       400)) for _ in range(16)]
            # wait until the server is busy with them, then ask it to stop
            deadline = time.monotonic() + 60
            while server.metric("quire:num_requests_running") < 1:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            server.proc.send_signal(signal.SIGTERM)
            return await asyncio.gather(*tasks, return_exceptions=True)

    try:
        results = asyncio.run(run())
        rc = server.proc.wait(timeout=60)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    log = "".join(server.log)
    assert rc == 0, log[-3000:]
    # every stream ended properly ([DONE]): finished, or aborted by the drain after the
    # shutdown timeout; none hung (gather returned within the bound)
    assert all(isinstance(r, tuple) and r[0] == 200 for r in results), results
    assert {r[3] for r in results} <= {"length", "abort"}
    assert "abort" in {r[3] for r in results}
    assert "Traceback" not in log, log[-3000:]
    with pytest.raises(httpx.TransportError):  # stopped accepting
        httpx.get(server.url + "/health", timeout=5)
