"""``quire serve`` as a child process for tests: started on an ephemeral port (read back
from uvicorn's start line), its stderr kept, its metrics and memory readable."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx


class ServeProcess:
    """``quire serve`` in a child process, port read back from uvicorn's start line (and
    ``grpc_address``, ``host:port``, from the gRPC server's, with ``--grpc-port``; with
    ``--no-http`` that line is the one waited for)."""

    def __init__(self, *args: str, env: dict[str, str] | None = None,
                 start_timeout: float = 120) -> None:
        cmd = [sys.executable, "-m", "quire.entrypoints.cli", "serve", "--device", "cpu", "--port", "0",
               "--log-level", "info", *args]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        self.log: list[str] = []
        deadline = time.monotonic() + start_timeout
        assert self.proc.stderr is not None
        while True:
            line = self.proc.stderr.readline()
            assert line or self.proc.poll() is None, "server died:\n" + "".join(self.log)
            self.log.append(line)
            grpc_line = re.search(r"gRPC running on (\S+)", line)
            if grpc_line:
                self.grpc_address = grpc_line.group(1)
                if "--no-http" in args:
                    break
            match = re.search(r"running on http://127\.0\.0\.1:(\d+)", line, re.IGNORECASE)
            if match:
                self.url = f"http://127.0.0.1:{match.group(1)}"
                break
            assert time.monotonic() < deadline, "no start line:\n" + "".join(self.log)
        # keep draining stderr so the child never blocks on a full pipe
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line)

    def descendants(self) -> dict[int, str]:
        """Every process below the server, by pid, with its role: "core" (an engine core),
        "worker" (a rank of the mp executor), "api" (an API server), or "other"."""
        return descendants(self.proc.pid)

    def rss_kib(self) -> int:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+)", status).group(1))  # type: ignore[union-attr]

    def metric(self, name: str) -> float:
        """``name``'s value, summed over its label sets (engine figures have one per
        data-parallel rank, every sample one per model); ``name{a="x"}`` sums those
        whose labels include ``a="x"``."""
        return metric_sum(httpx.get(self.url + "/metrics", timeout=10).text, name)

    def wait_idle(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while (self.metric("quire:num_kv_blocks_used") > 0
               or self.metric("quire:num_requests_running") > 0
               or self.metric("quire:num_requests_waiting") > 0):
            assert time.monotonic() < deadline, "KV pages or requests still held"
            time.sleep(0.1)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


def descendants(pid: int) -> dict[int, str]:
    """``pid``'s descendants (pid -> role), read from ``/proc``."""
    found: dict[int, str] = {}
    todo = [pid]
    while todo:
        out = subprocess.run(["pgrep", "-P", str(todo.pop())], capture_output=True,
                             text=True).stdout
        for child in map(int, out.split()):
            found[child] = _role(child)
            todo.append(child)
    return found


def _role(pid: int) -> str:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return "gone"
    for marker, role in (("core_proc", "core"), ("executor.multiproc", "worker"),
                         ("serve_processes", "api")):
        if marker in cmdline:
            return role
    return "other"


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def greedy_reference(url: str, jobs: set[tuple[str, int]], model: str = "tiny",
                     headers: dict[str, str] | None = None) -> dict[tuple[str, int], str]:
    """Each (prompt, max_tokens) job's greedy completion, one request at a time: what a
    client gets alone, to compare with what it gets under load."""
    out = {}
    for prompt, max_tokens in sorted(jobs):
        r = httpx.post(url + "/v1/completions", timeout=60, headers=headers, json={
            "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True})
        assert r.status_code == 200, r.text
        out[prompt, max_tokens] = r.json()["choices"][0]["text"]
    return out


def metric_sum(text: str, name: str) -> float:
    """The samples of ``name`` in exposition ``text`` summed over label sets, only those
    with the labels ``name`` gives in braces (``quire:processes{role="worker"}``)."""
    base, _, wanted = name.partition("{")
    want = set(re.findall(r'(\w+)="([^"]*)"', wanted))
    found = [float(value) for labels, value in
             re.findall(rf"^{re.escape(base)}(?:{{([^}}]*)}})? (\S+)$", text, re.MULTILINE)
             if want <= set(re.findall(r'(\w+)="([^"]*)"', labels))]
    assert found, f"{name} not in /metrics"
    return sum(found)
