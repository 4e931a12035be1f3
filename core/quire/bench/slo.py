"""Serving capacity under an SLO, as operators state one ("120 concurrent at p95 TTFT
2.0 s"): passes at increasing concurrency, and the highest level whose p95 TTFT and
end-to-end latency meet the targets (``quire bench serve --concurrency 1,2,4,8
--slo-ttft 2``).

A level *meets* the SLO when every request of its passes completed (an HTTP 503 or an
error is load the server did not carry) and each objective given holds at
:data:`QUANTILE` (the median of the level's passes). Levels run in the order given,
which must increase, and stop at the first that misses: latency only grows with
concurrency, so higher levels would take long to show the same. The capacity is the
highest level at which it and every level below met, a figure an operator can plan on.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise

from quire.bench.report import format_value, grid
from quire.bench.stats import SLO

#: The percentile the objectives are held to.
QUANTILE = 95


@dataclass(frozen=True)
class Level:
    """One concurrency level's figures (as :meth:`ServeRun.figures` names them) and
    whether they meet the SLO; ``misses`` says why not, one phrase per reason."""

    concurrency: int
    figures: Mapping[str, float]
    misses: tuple[str, ...]

    @property
    def met(self) -> bool:
        return not self.misses


def parse_levels(text: str) -> list[int]:
    """``"1,2,4,8"`` -> ``[1, 2, 4, 8]``; one value is one level.

    :raises ValueError: naming the item that is not an integer >= 1, or levels that do
        not increase.
    """
    levels = []
    for item in text.split(","):
        item = item.strip()
        if not item.isdigit() or int(item) < 1:
            raise ValueError(f"expected comma-separated integers >= 1, got {item!r} in "
                             f"{text!r}")
        levels.append(int(item))
    if any(b <= a for a, b in pairwise(levels)):
        raise ValueError(f"levels must increase, got {text!r}")
    return levels


def judge(concurrency: int, figures: Mapping[str, float], slo: SLO) -> Level:
    """Whether ``figures`` (one level's) meet ``slo`` at :data:`QUANTILE`.

    :raises ValueError: when ``slo`` sets no objective.
    """
    if not slo.is_set:
        raise ValueError("an SLO needs a TTFT or an end-to-end objective")
    misses = []
    failed = figures.get("overloaded_503", 0) + figures.get("errors", 0)
    if failed:
        misses.append(f"{format_value(failed)} requests failed")
    for name, key, target in (("TTFT", "ttft_s", slo.ttft_s), ("E2E", "e2e_s", slo.e2e_s)):
        if target is None:
            continue
        value = figures.get(f"{key}_p{QUANTILE}", math.nan)
        if math.isnan(value):
            misses.append(f"no {name} measured")
        elif value > target:
            misses.append(f"{name} p{QUANTILE} {value:.3g}s > {target:g}s")
    return Level(concurrency, dict(figures), tuple(misses))


def step_levels(levels: Sequence[int], measure: Callable[[int], Mapping[str, float]],
                slo: SLO) -> list[Level]:
    """Each level's :func:`judge`\\ ment, measured in order by ``measure(concurrency)``,
    up to and including the first that misses."""
    judged = []
    for concurrency in levels:
        judged.append(judge(concurrency, measure(concurrency), slo))
        if not judged[-1].met:
            break
    return judged


def capacity(levels: Sequence[Level]) -> int | None:
    """The highest concurrency at which it and every level before met; None if the
    first missed (or there is none)."""
    best = None
    for level in levels:
        if not level.met:
            break
        best = level.concurrency
    return best


def describe(slo: SLO) -> str:
    """``p95 TTFT <= 2s, E2E <= 30s``."""
    parts = [f"{name} <= {target:g}s" for name, target in (("TTFT", slo.ttft_s),
                                                          ("E2E", slo.e2e_s))
             if target is not None]
    return f"p{QUANTILE} " + ", ".join(parts)


def report(levels: Sequence[Level], slo: SLO) -> str:
    """A table of the levels run, and the capacity line."""
    rows = []
    for level in levels:
        f = level.figures
        ms = [format_value(f.get(f"{key}_p{QUANTILE}", math.nan) * 1000.0)
              for key in ("ttft_s", "e2e_s")]
        rows.append([str(level.concurrency), format_value(f.get("completed")),
                     format_value(f.get("overloaded_503", 0) + f.get("errors", 0)), *ms,
                     format_value(f.get("requests_per_s")),
                     "yes" if level.met else "no: " + "; ".join(level.misses)])
    table = grid(["concurrency", "completed", "failed", f"TTFT p{QUANTILE} (ms)",
                  f"E2E p{QUANTILE} (ms)", "requests/s", "meets SLO"], rows)
    best = capacity(levels)
    verdict = (f"capacity: {best} concurrent at {describe(slo)}" if best is not None else
               f"capacity: no level tried meets {describe(slo)}")
    return f"{table}\n{verdict}"
