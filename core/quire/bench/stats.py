"""Statistics of benchmark samples: percentiles, medians over repeats, goodput.

Percentiles interpolate linearly between the two nearest ranks (numpy's default
``linear`` method), so p50 of an even number of samples is the mean of the middle two.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0 <= q <= 100) of ``values``; NaN when there are none.

    :raises ValueError: for ``q`` outside [0, 100].
    """
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def median(values: Sequence[float]) -> float:
    return percentile(values, 50.0)


def distribution(prefix: str, values: Sequence[float],
                 quantiles: Iterable[int] = (50, 95, 99)) -> dict[str, float]:
    """``{prefix}_p50``, ``{prefix}_p95``, ... and ``{prefix}_mean`` of ``values``."""
    figures = {f"{prefix}_p{q}": percentile(values, q) for q in quantiles}
    figures[f"{prefix}_mean"] = sum(values) / len(values) if values else math.nan
    return figures


def median_figures(runs: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Per figure, the median over repeated runs (figures missing from a run are skipped)."""
    keys: list[str] = []
    for run in runs:
        keys.extend(k for k in run if k not in keys)
    result = {}
    for key in keys:
        values = [run[key] for run in runs if key in run and not math.isnan(run[key])]
        result[key] = median(values)
    return result


@dataclass(frozen=True)
class SLO:
    """Service-level objectives in seconds; None means not asked for."""

    ttft_s: float | None = None
    e2e_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_s", "e2e_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"SLO {name} must be > 0 seconds, got {value}")

    @property
    def is_set(self) -> bool:
        return self.ttft_s is not None or self.e2e_s is not None

    def met(self, ttft_s: float, e2e_s: float) -> bool:
        """Whether one request met every objective given."""
        return (self.ttft_s is None or ttft_s <= self.ttft_s) \
            and (self.e2e_s is None or e2e_s <= self.e2e_s)


def goodput(samples: Iterable[tuple[float, float]], duration_s: float, slo: SLO) -> float:
    """Requests per second that met every objective of ``slo``.

    :param samples: (TTFT, end-to-end latency) of each *successful* request.
    :param duration_s: the wall time of the whole run.
    """
    if duration_s <= 0:
        return math.nan
    return sum(1 for ttft, e2e in samples if slo.met(ttft, e2e)) / duration_s


@dataclass(frozen=True)
class SpecCounts:
    """Speculative decoding's counters at one moment (vLLM's ``spec_decode`` ones)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    #: Drafts accepted at each position (0-based) of their proposal.
    accepted_per_pos: tuple[int, ...] = ()


def spec_figures(before: SpecCounts, after: SpecCounts) -> dict[str, float]:
    """Speculative decoding over a run, from the counters before and after it: the share
    of drafts accepted, tokens per verification (accepted drafts + 1, vLLM's mean
    acceptance length), and the acceptance rate at each draft position. Empty when no
    draft was verified."""
    drafts = after.num_drafts - before.num_drafts
    if drafts <= 0:
        return {}
    proposed = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    figures = {"spec_draft_tokens": float(proposed), "spec_accepted_tokens": float(accepted),
               "spec_acceptance_rate": accepted / proposed if proposed else 0.0,
               "spec_mean_acceptance_length": 1.0 + accepted / drafts}
    old = before.accepted_per_pos
    for pos, count in enumerate(after.accepted_per_pos):
        figures[f"spec_acceptance_rate_pos{pos}"] = \
            (count - (old[pos] if pos < len(old) else 0)) / drafts
    return figures
