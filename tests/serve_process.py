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
    """``quire serve`` in a child process, port read back from uvicorn's start line."""

    def __init__(self, *args: str, env: dict[str, str] | None = None,
                 start_timeout: float = 120) -> None:
        cmd = [sys.executable, "-m", "quire.cli", "serve", "--device", "cpu", "--port", "0",
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

    def rss_kib(self) -> int:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+)", status).group(1))  # type: ignore[union-attr]

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
        assert match, f"{name} not in /metrics"
        return float(match.group(1))

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
