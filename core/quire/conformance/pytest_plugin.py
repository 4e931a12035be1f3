"""The conformance checks as pytest tests, one test per check, for a vendor's own suite.

In a test module of your plugin's repository::

    from quire.conformance.pytest_plugin import conformance_tests

    test_mydevice_conformance = conformance_tests("mydevice", require_available=True)

pytest then collects ``test_mydevice_conformance[platform]``, ``[kv-write]``,
``[attention]``, ``[memory]``, ``[communicator]`` and ``[end-to-end]``. A check with a FAIL
row fails with the table in its message; one whose rows are all "not available" (or all
"not run") is skipped with the reason, unless ``require_available`` makes "not available"
a failure. For kernels-only runs set ``TRITON_INTERPRET=1`` in pytest's environment
before it starts: by the time this module is imported, triton may be imported already.

pytest is imported only when :func:`conformance_tests` is called; the core does not
depend on it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from quire.conformance.report import Outcome, Report
from quire.conformance.runner import CHECK_IDS, ConformanceOptions, run_by_name, run_conformance
from quire.interfaces.platform import Platform


def conformance_tests(
    device: str | Callable[[], Platform],
    *,
    kernels_only: bool = False,
    dtypes: Iterable[torch.dtype] | None = None,
    checks: Iterable[str] | None = None,
    require_available: bool = False,
) -> Callable[[str], None]:
    """A test function parametrized over the checks (assign it to a ``test_*`` name).

    :param device: a platform name, resolved through the installed plugins (honouring
        ``QUIRE_DISABLE_PLUGINS``), or a factory returning the platform to test.
    :param checks: check ids to include (default: all of :data:`~quire.conformance.
        runner.CHECK_IDS`).
    """
    import pytest

    ids = tuple(checks) if checks is not None else CHECK_IDS
    wanted = tuple(dtypes) if dtypes else None

    @pytest.mark.parametrize("check", ids)
    def test_conformance(check: str) -> None:
        options = ConformanceOptions(kernels_only=kernels_only, dtypes=wanted, checks=(check,))
        report = _run(device, options)
        verdict = judge(report, require_available)
        if verdict is not None:
            outcome, message = verdict
            (pytest.fail if outcome is Outcome.FAIL else pytest.skip)(message)

    return test_conformance


def judge(report: Report, require_available: bool) -> tuple[Outcome, str] | None:
    """What one check's report means for its test: None to pass, else (FAIL or a skip
    outcome, message)."""
    table = "\n".join(report.table())
    counts = report.counts
    if report.failed:
        return Outcome.FAIL, table
    if counts[Outcome.NOT_AVAILABLE]:
        if require_available:
            return Outcome.FAIL, f"required but not available:\n{table}"
        if not counts[Outcome.PASS]:
            return Outcome.NOT_AVAILABLE, report.results[0].result_text
    if not counts[Outcome.PASS] and counts[Outcome.NOT_RUN]:
        return Outcome.NOT_RUN, report.results[0].result_text
    return None


def _run(device: str | Callable[[], Platform], options: ConformanceOptions) -> Report:
    if not isinstance(device, str):
        return run_conformance(device(), options)
    import os

    from quire.plugins.registry import DISABLE_PLUGINS_ENV, PlatformRegistry, parse_plugin_names

    blocked = parse_plugin_names(os.environ.get(DISABLE_PLUGINS_ENV))
    return run_by_name(PlatformRegistry(blocked=blocked), device, options)
