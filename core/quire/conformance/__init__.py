"""The conformance suite: does a platform plugin behave like the cpu reference?

Shipped inside the core so a vendor runs it against its own plugin without this
repository: ``quire conformance --device NAME`` (see docs/conformance.md), the Python API
below, or :func:`quire.conformance.pytest_plugin.conformance_tests` in a test module.

Modules, one job each:

- ``runner``: which checks run in which mode; :func:`run_conformance`, :func:`run_by_name`;
- ``checks``: platform contract, KV write, paged attention, memory profiler;
- ``collectives``: the communicator check, collectives and send/recv (world size 1, and 2
  and 4 in spawned processes);
- ``end_to_end``: greedy generation on the platform vs on cpu, token for token;
- ``cases``: random paged batches, and running one on any backend whatever its layout;
- ``tolerances``: per-dtype tolerances and why; comparing an output with the reference;
- ``tiny_model``: a tiny random-weight checkpoint with a tokenizer, built in a directory;
- ``context``: what every check receives; ``report``: the rows and the table;
- ``pytest_plugin``: the same checks as parametrized pytest tests.
"""

from quire.conformance.report import CheckResult, Outcome, Report
from quire.conformance.runner import (
    CHECK_IDS,
    CHECKS,
    ConformanceOptions,
    run_by_name,
    run_conformance,
)

__all__ = [
    "CHECKS",
    "CHECK_IDS",
    "CheckResult",
    "ConformanceOptions",
    "Outcome",
    "Report",
    "run_by_name",
    "run_conformance",
]
