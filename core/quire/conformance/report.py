"""What a conformance run found: one row per check (or per case of a check), and its table.

A row's outcome is one of four, and only ``FAIL`` is a failure:

- ``pass``: the check ran and every comparison was within its tolerance;
- ``FAIL: <why>``: the check ran and the backend broke the contract;
- ``not available: <reason>``: the platform (or its backend) cannot run here, for the
  platform's own reason; nothing was compared;
- ``not run: <why>``: the suite chose not to run it (kernels-only mode, too few devices,
  a block size or head size the backend refused).
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass


class Outcome(enum.Enum):
    PASS = "pass"
    FAIL = "FAIL"
    NOT_AVAILABLE = "not available"
    NOT_RUN = "not run"


@dataclass(frozen=True)
class CheckResult:
    """One row of the table."""

    #: The check's title, e.g. ``"paged attention"``.
    check: str
    outcome: Outcome
    #: What was run, e.g. ``"bfloat16, block 16"``; empty for a check with one row.
    case: str = ""
    #: Why it failed, was not available or was not run; empty for a pass.
    reason: str = ""
    #: The measurement behind the verdict, e.g. ``"max |err| 3.1e-07, tol 1e-04"``.
    figure: str = ""

    def __post_init__(self) -> None:
        if self.outcome is not Outcome.PASS and not self.reason:
            raise ValueError(f"a '{self.outcome.value}' result must say why ({self.label})")

    @property
    def label(self) -> str:
        return f"{self.check} [{self.case}]" if self.case else self.check

    @property
    def result_text(self) -> str:
        if self.outcome is Outcome.PASS:
            return "pass"
        return f"{self.outcome.value}: {self.reason}"


@dataclass(frozen=True)
class Report:
    """Every row of one run, and what the run was."""

    platform: str
    #: ``"full"``, ``"kernels-only"``, ``"unavailable"`` or ``"broken"`` (see the runner).
    mode: str
    #: The torch device the checks ran on, or ``"-"`` when none was used.
    device: str
    results: tuple[CheckResult, ...]
    #: The platform's reason when it is not available here, else ``""``.
    unavailable_reason: str = ""

    @property
    def failed(self) -> bool:
        return any(r.outcome is Outcome.FAIL for r in self.results)

    @property
    def counts(self) -> Counter[Outcome]:
        return Counter(r.outcome for r in self.results)

    def exit_code(self, require_available: bool = False) -> int:
        """1 when a check failed, or when something was not available and
        ``require_available``; else 0. "not run" never fails a run."""
        if self.failed:
            return 1
        if require_available and self.counts[Outcome.NOT_AVAILABLE]:
            return 1
        return 0

    def table(self) -> list[str]:
        """The rows as aligned text: CHECK, RESULT, FIGURE."""
        rows = [("CHECK", "RESULT", "FIGURE")]
        rows += [(r.label, r.result_text, r.figure) for r in self.results]
        w0 = max(len(row[0]) for row in rows)
        # A long reason would push every figure far right; cap the padding, not the text.
        w1 = min(max(len(row[1]) for row in rows), 40)
        return [f"{a.ljust(w0)}  {b.ljust(w1)}  {c}".rstrip() for a, b, c in rows]

    def summary(self) -> str:
        counts = self.counts
        parts = [f"{counts[o]} {o.value}" for o in Outcome if counts[o]]
        return f"{self.platform} ({self.mode}): " + ", ".join(parts or ["no checks"])
