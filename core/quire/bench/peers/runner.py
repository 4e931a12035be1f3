"""Running a peer's worker: a subprocess with the peer venv's Python, a JSON job in, a
JSON result out, and the result turned into the same run records Quire's runs fill.

The worker's output (logs, progress) goes to our stderr, so stdout keeps only tables.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quire.bench.latency import LatencyRun, RequestTiming
from quire.bench.peers.spec import PeerSpec
from quire.bench.throughput import ThroughputRun
from quire.bench.workloads import BenchRequest


class PeerError(RuntimeError):
    """A peer is not installed, or its worker failed; the message says which and why."""


@dataclass(frozen=True)
class PeerResult:
    """A peer's runs of one workload, with what it was."""

    column: str
    description: str
    load_s: float
    runs: list[ThroughputRun] | list[LatencyRun]


def check_installed(spec: PeerSpec) -> Path:
    """The venv's Python. :raises PeerError: naming the install command when absent."""
    python = spec.python()
    if not python.exists():
        raise PeerError(f"peer {spec.name!r} is not installed ({python} is missing); "
                        f"install it with: quire bench install-peer {spec.name}")
    return python


def run_worker(spec: PeerSpec, job: dict[str, Any], timeout_s: float | None = None
               ) -> dict[str, Any]:
    """Run ``job`` in ``spec``'s worker. :raises PeerError: when it fails or times out."""
    python = check_installed(spec)
    env = dict(os.environ)
    for name, value in spec.env.items():
        env.setdefault(name, value)
    with tempfile.TemporaryDirectory(prefix=f"quire-bench-{spec.name}-") as tmp:
        job_path, result_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(json.dumps(job), encoding="utf-8")
        cmd = [str(python), str(spec.worker), str(job_path), str(result_path)]
        try:
            proc = subprocess.run(cmd, env=env, stdout=_stderr_fd(), timeout=timeout_s,
                                  check=False)
        except subprocess.TimeoutExpired:
            raise PeerError(f"the {spec.name} worker took longer than {timeout_s:.0f}s "
                            f"({job.get('action')})") from None
        if proc.returncode != 0 or not result_path.exists():
            raise PeerError(f"the {spec.name} worker failed ({job.get('action')}, exit "
                            f"{proc.returncode}); its output is above on stderr")
        return json.loads(result_path.read_text(encoding="utf-8"))


def _stderr_fd() -> int | None:
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a capture with no file behind it
        return None


def job_runs(runs: list[list[BenchRequest]]) -> list[list[dict[str, Any]]]:
    """The workload passes as the JSON a worker reads."""
    return [[{"prompt_token_ids": list(r.prompt_token_ids), "output_len": r.output_len}
             for r in requests] for requests in runs]


def measure(spec: PeerSpec, mode: str, column: str, model: str,
            runs: list[list[BenchRequest]], options: dict[str, Any] | None = None,
            timeout_s: float | None = None) -> PeerResult:
    """``mode`` ("throughput" or "latency") of every pass in ``runs`` on ``model``.

    :raises PeerError: as :func:`run_worker`.
    """
    job = {"action": mode, "model": model, "runs": job_runs(runs), "options": options or {}}
    result = run_worker(spec, job, timeout_s)
    if mode == "throughput":
        records: list[Any] = [ThroughputRun(**run) for run in result["runs"]]
    else:
        records = [LatencyRun([RequestTiming(**t) for t in run["requests"]],
                              run.get("peak_rss_bytes")) for run in result["runs"]]
    return PeerResult(column, result["engine"], float(result.get("load_s", 0.0)), records)
