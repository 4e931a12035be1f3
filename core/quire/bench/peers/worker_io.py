"""What every peer worker shares: reading its job, writing its result, timing runs.

Standard library only. A worker is run as ``<venv>/bin/python <worker>.py JOB RESULT``
with the peer's own Python; this directory is then first on ``sys.path``, so workers
import this module (and ``procmem``, ``clock``) by their plain names.

A job is JSON::

    {"action": "throughput" | "latency" | <a worker's own action>,
     "model": "<path>",
     "runs": [[{"prompt_token_ids": [...], "output_len": N}, ...], ...],  # one list per repeat
     "options": {...}}

and the result is JSON with ``engine`` (a description), ``load_s``, and ``runs``: per
repeat, for throughput ``{elapsed_s, num_requests, prompt_tokens, output_tokens,
peak_rss_bytes}``, for latency ``{requests: [{ttft_s, e2e_s, output_tokens, itl_s}],
peak_rss_bytes}``.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

Job = dict[str, Any]


def log(message: str) -> None:
    print(f"[{os.path.basename(sys.argv[0])}] {message}", file=sys.stderr, flush=True)


def main(actions: dict[str, Callable[[Job], dict[str, Any]]]) -> None:
    """Run the job named on the command line with the matching action; write its result."""
    if len(sys.argv) != 3:
        sys.exit(f"usage: {sys.argv[0]} JOB.json RESULT.json")
    with open(sys.argv[1], encoding="utf-8") as f:
        job = json.load(f)
    action = actions.get(job.get("action"))
    if action is None:
        sys.exit(f"unknown action {job.get('action')!r}; this worker does {sorted(actions)}")
    result = action(job)
    partial = sys.argv[2] + ".partial"
    with open(partial, "w", encoding="utf-8") as f:
        json.dump(result, f)
    os.replace(partial, sys.argv[2])  # the caller never reads half a result


def throughput_result(elapsed_s: float, requests: list[dict[str, Any]], output_tokens: int,
                      peak_rss_bytes: int | None) -> dict[str, Any]:
    """One throughput run's result entry.

    :raises RuntimeError: when the engine made a different number of tokens than asked.
    """
    expected = sum(r["output_len"] for r in requests)
    if output_tokens != expected:
        raise RuntimeError(f"made {output_tokens} output tokens, expected {expected}")
    return {"elapsed_s": elapsed_s, "num_requests": len(requests),
            "prompt_tokens": sum(len(r["prompt_token_ids"]) for r in requests),
            "output_tokens": output_tokens, "peak_rss_bytes": peak_rss_bytes}
