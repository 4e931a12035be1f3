"""``quire serve`` as processes: API servers in front of engine core processes (and their
workers). With the ``openai`` client: concurrent streams get the same text as alone,
``/metrics`` counts every API server and shows each replica's work, ``kill -9`` of any
process ends in-flight requests with an error, the server exits non-zero and nothing is
left; SIGTERM drains every process and exits 0."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import openai
import pytest
from serve_process import ServeProcess, alive

MODEL = "tiny"
# prompts that differ from their first page on, so that placement goes by load alone
PROMPTS = [f"{i} Once upon a time, in a land of {word}" for i, word in
           enumerate(["rivers", "stone", "glass", "wind", "salt", "moss", "iron", "snow"])]


def _serve(tiny_checkpoint, *args: str) -> ServeProcess:
    return ServeProcess("--model", str(tiny_checkpoint("llama")), "--served-model-name", MODEL,
                        "--max-model-len", "256", *args)


async def _streams(url: str, prompts: list[str], max_tokens: int) -> list[str]:
    """One streaming completion per prompt, all at once; each one's text."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                                timeout=120)

    async def one(prompt: str) -> str:
        stream = await client.completions.create(model=MODEL, prompt=prompt,
                                                 max_tokens=max_tokens, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        return "".join([chunk.choices[0].text async for chunk in stream])

    try:
        return await asyncio.gather(*(one(p) for p in prompts))
    finally:
        await client.close()


def _alone(url: str, prompts: list[str], max_tokens: int) -> dict[str, str]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    return {p: client.completions.create(model=MODEL, prompt=p, max_tokens=max_tokens,
                                         temperature=0, extra_body={"ignore_eos": True}
                                         ).choices[0].text for p in set(prompts)}


async def _kill_mid_streams(url: str, pid: int) -> list[list[str]]:
    """Eight long streams; once each has sent a chunk, ``kill -9 pid``; every stream's
    lines to its end."""
    body = {"model": MODEL, "max_tokens": 220, "ignore_eos": True, "stream": True}
    started = asyncio.Event()
    first: list[int] = []

    async def one(client: httpx.AsyncClient, prompt: str) -> list[str]:
        lines: list[str] = []
        async with client.stream("POST", url + "/v1/completions",
                                 json={**body, "prompt": prompt}) as resp:
            async for line in resp.aiter_lines():
                if line:
                    lines.append(line)
                    if len(lines) == 1:
                        first.append(1)
                        if len(first) == len(PROMPTS):
                            started.set()
                        await started.wait()
        return lines

    async with httpx.AsyncClient(timeout=120) as client:
        tasks = [asyncio.ensure_future(one(client, p)) for p in PROMPTS]
        await asyncio.wait_for(started.wait(), 60)
        os.kill(pid, signal.SIGKILL)
        return await asyncio.gather(*tasks)


def _engine_requests(srv: ServeProcess) -> dict[str, float]:
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    return {line.split('"')[1]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("quire:engine_requests_total{")}


def _stopped_cleanly(srv: ServeProcess, below: dict[int, str]) -> int:
    rc = srv.stop()
    deadline = time.monotonic() + 10
    while any(alive(p) for p in below) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = {p: role for p, role in below.items() if alive(p)}
    assert not left, f"left behind: {left}"
    return rc


@pytest.mark.slow  # two API servers over two engine cores: about 20 s
def test_dp2_behind_two_api_servers(tiny_checkpoint):
    srv = _serve(tiny_checkpoint, "--data-parallel-size", "2", "--api-server-count", "2")
    below = srv.descendants()
    try:
        assert sorted(below.values()) == ["api", "api", "core", "core"], below
        prompts = PROMPTS * 2
        alone = _alone(srv.url, prompts, 12)
        together = asyncio.run(_streams(srv.url, prompts, 12))
        assert together == [alone[p] for p in prompts]
        placed = _engine_requests(srv)
        assert set(placed) == {"0", "1"} and all(placed.values()), placed
        assert sum(placed.values()) == len(prompts) + len(set(prompts))
        # the request counters of both API servers are summed, whichever answers
        assert srv.metric('quire:request_success_total{finished_reason="length"}') == \
            len(prompts) + len(set(prompts))
        assert srv.metric('quire:processes{role="engine_core"}') == 2
        assert srv.metric('quire:processes{role="api_server"}') == 2
    finally:
        rc = _stopped_cleanly(srv, below)
    assert rc == 0, "".join(srv.log[-20:])


def test_a_killed_engine_core_fails_requests_and_stops_the_server(tiny_checkpoint):
    """The core dies while a non-streamed request runs: HTTP 500 in OpenAI's shape, and
    the server exits non-zero within seconds."""
    srv = _serve(tiny_checkpoint)
    below = srv.descendants()
    try:
        [core] = [p for p, role in below.items() if role == "core"]

        async def kill_while_running() -> httpx.Response:
            async with httpx.AsyncClient(timeout=60) as client:
                request = asyncio.ensure_future(client.post(
                    srv.url + "/v1/completions",
                    json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 200,
                          "ignore_eos": True, "temperature": 0}))
                while srv.metric("quire:num_requests_running") < 1:
                    await asyncio.sleep(0.02)
                os.kill(core, signal.SIGKILL)
                return await request

        killed = time.monotonic()
        resp = asyncio.run(kill_while_running())
        assert resp.status_code == 500, resp.text
        error = resp.json()["error"]
        assert error["type"] == "server_error" and "engine core 0" in error["message"]
        assert srv.proc.wait(timeout=30) == 1
        assert time.monotonic() - killed < 30
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
    assert not any(alive(p) for p in below)


@pytest.mark.slow
def test_dp2_x_tp2_sixty_four_streams_then_a_killed_worker(tiny_checkpoint):
    """2 replicas of 2 ranks (2 cores, 4 workers): 64 concurrent streams give the texts
    of one request alone; both replicas take work; ``kill -9`` of one worker ends the
    in-flight streams with an error event and ``[DONE]``, the server exits non-zero
    within 30 s, and no process is left."""
    srv = ServeProcess("--model", str(tiny_checkpoint("llama")), "--served-model-name", MODEL,
                       "--max-model-len", "256", "--data-parallel-size", "2",
                       "--tensor-parallel-size", "2")
    below = srv.descendants()
    try:
        assert sorted(below.values()) == ["core"] * 2 + ["worker"] * 4, below
        prompts = PROMPTS * 8
        alone = _alone(srv.url, prompts, 16)
        together = asyncio.run(_streams(srv.url, prompts, 16))
        assert together == [alone[p] for p in prompts]
        placed = _engine_requests(srv)
        assert all(v >= 16 for v in placed.values()), placed
        assert srv.metric('quire:processes{role="worker"}') == 4

        worker = next(p for p, role in below.items() if role == "worker")
        ended = asyncio.run(_kill_mid_streams(srv.url, worker))
        killed = time.monotonic()
        assert all(lines[-1] == "data: [DONE]" for lines in ended), [e[-2:] for e in ended]
        failed = [lines for lines in ended if '"server_error"' in lines[-2]]
        assert failed, [e[-2:] for e in ended]
        assert all("engine core" in lines[-2] for lines in failed)
        assert srv.proc.wait(timeout=30) == 1
        assert time.monotonic() - killed < 30
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
    deadline = time.monotonic() + 10
    while any(alive(p) for p in below) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in below if alive(p)]


@pytest.mark.slow  # a whole process tree per layout: about 15 s each
@pytest.mark.parametrize("layout", [[], ["--engine-in-process"]])
def test_ctrl_c_to_the_process_group_drains_every_process(tiny_checkpoint, layout):
    """A terminal's Ctrl-C is SIGINT to every process of the group (API server, core,
    workers): the server drains (the running stream still ends with [DONE]), exits 0,
    and leaves nothing. Workers ignore it whoever started them."""
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-m", "quire.entrypoints.cli", "serve", "--device", "cpu",
         "--port", "0", "--model", str(tiny_checkpoint("llama")), "--served-model-name",
         MODEL, "--max-model-len", "256", "--tensor-parallel-size", "2", *layout],
        stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        url = None
        while url is None:
            line = proc.stderr.readline()
            assert line, "server died"
            if "running on http://" in line.lower():
                url = "http://" + line.split("http://")[1].split()[0]
        below = list(__import__("serve_process").descendants(proc.pid))
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 200, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as resp:
            lines = resp.iter_lines()
            assert next(line for line in lines if line).startswith("data: {")
            os.killpg(proc.pid, signal.SIGINT)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and '"server_error"' not in "".join(rest)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while any(alive(p) for p in below) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in below if alive(p)]
