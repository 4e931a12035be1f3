"""Benchmark results: text tables for stdout and a JSON record for comparing runs over time.

A :class:`Column` is one engine's results (Quire, or a peer): the figures of every
repeat and their medians. Comparison tables put Quire first and add a ``quire/<peer>``
ratio column per peer on every figure; whether a ratio above 1 is good depends on the
figure (tokens/s: Quire is faster; latency and memory: Quire is slower or bigger).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quire.bench.stats import median_figures


@dataclass(frozen=True)
class Figure:
    """One reported quantity: its key in the figures, its label, and how it is shown."""

    key: str
    label: str
    #: Multiplied in before display (seconds are shown as milliseconds).
    scale: float = 1.0


def _seconds_as_ms(prefix: str, name: str, quantiles: Iterable[int]) -> list[Figure]:
    return [Figure(f"{prefix}_p{q}", f"{name} p{q} (ms)", 1000.0) for q in quantiles]


#: Speculative decoding's, where a run verified drafts (:func:`quire.bench.stats.
#: spec_figures`; ``bench serve`` reads the counters from the server's /metrics).
SPEC_FIGURES = (
    Figure("spec_draft_tokens", "draft tokens"),
    Figure("spec_accepted_tokens", "drafts accepted"),
    Figure("spec_acceptance_rate", "draft acceptance rate"),
    Figure("spec_mean_acceptance_length", "tokens per verification"),
    *(Figure(f"spec_acceptance_rate_pos{i}", f"acceptance rate, draft {i}")
      for i in range(16)),
)
THROUGHPUT_FIGURES = (
    Figure("requests_per_s", "requests/s"),
    Figure("output_tokens_per_s", "output tokens/s"),
    Figure("total_tokens_per_s", "total tokens/s"),
    Figure("peak_rss_mib", "peak RSS (MiB)"),
    Figure("peak_kv_mib", "peak KV in use (MiB)"),
    Figure("kv_pool_mib", "KV pool (MiB)"),
    Figure("elapsed_s", "elapsed (s)"),
    *SPEC_FIGURES,
)
LATENCY_FIGURES = (
    *_seconds_as_ms("ttft_s", "TTFT", (50, 95)),
    *_seconds_as_ms("itl_s", "ITL", (50, 95)),
    *_seconds_as_ms("e2e_s", "end-to-end", (50, 95)),
    Figure("decode_tokens_per_s", "decode tokens/s"),
    Figure("peak_rss_mib", "peak RSS (MiB)"),
    *SPEC_FIGURES,
)
SERVE_FIGURES = (
    Figure("completed", "completed"),
    Figure("overloaded_503", "HTTP 503"),
    Figure("errors", "other errors"),
    Figure("requests_per_s", "requests/s"),
    Figure("goodput_requests_per_s", "goodput (requests/s in SLO)"),
    Figure("output_tokens_per_s", "output tokens/s"),
    *_seconds_as_ms("ttft_s", "TTFT", (50, 95, 99)),
    *_seconds_as_ms("itl_s", "ITL", (50, 95, 99)),
    *_seconds_as_ms("e2e_s", "end-to-end", (50, 95, 99)),
    Figure("usage_prompt_match", "share with usage.prompt_tokens as sent"),
    Figure("duration_s", "duration (s)"),
    *SPEC_FIGURES,
)
MEMORY_FIGURES = (
    Figure("peak_concurrency", "peak concurrent seqs"),
    Figure("mean_concurrency", "mean concurrent seqs"),
    Figure("steps", "steps to finish"),
    Figure("waste_share", "wasted share of held KV"),
    Figure("filled_share", "budget holding tokens"),
    Figure("preemptions", "preemptions"),
)


@dataclass
class Column:
    """One engine's results: every repeat's figures, and a description of the engine."""

    name: str
    description: str
    runs: list[dict[str, float]] = field(default_factory=list)

    @property
    def median(self) -> dict[str, float]:
        return median_figures(self.runs)


def format_value(value: float | None) -> str:
    """Four significant digits, whole numbers as such, '-' for nothing."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if float(value).is_integer() and abs(value) < 1e9:
        return str(int(value))
    return f"{value:.4g}"


def grid(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain text table: the first column left-aligned, the others right-aligned."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        first = str(cells[0]).ljust(widths[0])
        rest = [str(c).rjust(w) for c, w in zip(cells[1:], widths[1:])]
        return "  ".join([first, *rest]).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or math.isnan(a) or math.isnan(b) or b == 0:
        return None
    return a / b


def comparison_table(figures: Sequence[Figure], columns: Sequence[Column]) -> str:
    """Figures down, engines across, then ``quire/<peer>`` for each peer."""
    medians = [c.median for c in columns]
    headers = ["figure", *(c.name for c in columns),
               *(f"{columns[0].name}/{c.name}" for c in columns[1:])]
    rows = []
    for fig in figures:
        values = [m.get(fig.key) for m in medians]
        if all(v is None for v in values):
            continue
        shown = [None if v is None else v * fig.scale for v in values]
        ratios = [ratio(values[0], v) for v in values[1:]]
        rows.append([fig.label, *(format_value(v) for v in shown),
                     *(("-" if r is None else f"{r:.2f}x") for r in ratios)])
    return grid(headers, rows)


def figure_rows(figures: Sequence[Figure], keyed: Mapping[str, Mapping[str, float]],
                key_header: str) -> str:
    """One row per entry of ``keyed`` (a sweep value, a policy), figures across."""
    present = [f for f in figures if any(f.key in row for row in keyed.values())]
    headers = [key_header, *(f.label for f in present)]
    rows = [[name, *(format_value(None if f.key not in row else row[f.key] * f.scale)
                     for f in present)]
            for name, row in keyed.items()]
    return grid(headers, rows)


def environment() -> dict[str, Any]:
    """Where and when: enough to tell two result files apart later."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        quire_version = version("quire")
    except PackageNotFoundError:
        quire_version = None
    return {
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "quire_version": quire_version,
        "git_revision": _git_revision(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
    }


def _git_revision() -> str | None:
    """The checkout's commit, or None outside a git checkout."""
    try:
        proc = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0:
        return None
    return proc.stdout.strip() or None


def record(command: str, settings: Mapping[str, Any], columns: Sequence[Column] = (),
           **extra: Any) -> dict[str, Any]:
    """The JSON record of one invocation."""
    payload: dict[str, Any] = {"tool": "quire bench", "command": command,
                               **environment(), "settings": dict(settings)}
    if columns:
        payload["results"] = {c.name: {"description": c.description, "median": c.median,
                                       "runs": c.runs} for c in columns}
        base = columns[0]
        payload["ratios"] = {
            f"{base.name}/{c.name}": {k: ratio(v, c.median.get(k))
                                      for k, v in base.median.items()}
            for c in columns[1:]}
    payload.update(extra)
    return payload


def write_json(path: str | os.PathLike[str], payload: Mapping[str, Any]) -> None:
    """Write ``payload`` as JSON (NaN becomes null, which JSON can hold)."""
    text = json.dumps(_finite(payload), indent=2, sort_keys=False)
    Path(path).write_text(text + "\n", encoding="utf-8")


def _finite(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
