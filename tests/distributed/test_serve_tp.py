"""``quire serve --tensor-parallel-size 2``: answers like one process; ``kill -9`` of a
worker fails the in-flight request with an error event and ``[DONE]``, ``/health``
turns 503, the server exits non-zero (for a supervisor to restart it), and no process
(engine core, worker) is left behind."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
from serve_process import ServeProcess, alive

MODEL = "tiny"


@pytest.mark.slow
def test_serve_tp2_worker_killed(tiny_checkpoint):
    srv = ServeProcess("--model", str(tiny_checkpoint("llama")), "--served-model-name", MODEL,
                       "--tensor-parallel-size", "2", "--max-model-len", "128")
    try:
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8,
                "temperature": 0, "ignore_eos": True}
        alone = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
        assert alone.status_code == 200, alone.text
        below = srv.descendants()
        workers = [pid for pid, role in below.items() if role == "worker"]
        assert sorted(below.values()) == ["core", "worker", "worker"], below
        os.kill(workers[1], signal.SIGKILL)
        killed = time.monotonic()
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=60,
                          json={**body, "stream": True}) as resp:
            lines = [line for line in resp.iter_lines() if line]
        assert resp.status_code == 200 and lines[-1] == "data: [DONE]", lines
        assert '"server_error"' in lines[-2] and "rank 1" in lines[-2], lines
        rc = srv.proc.wait(timeout=30)
        assert rc != 0 and time.monotonic() - killed < 30
        for pid in below:
            assert not alive(pid), f"process {pid} ({below[pid]}) left behind"
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
