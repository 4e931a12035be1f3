"""The suite's modes, its report and its command line: what runs where, what each result
means for the exit status, and that kernels-only never reports a device check as passed."""

from __future__ import annotations

import os
import subprocess
import sys

import broken_platforms as broken
import pytest
import torch
from quire.conformance import CHECK_IDS, ConformanceOptions, Outcome, run_conformance
from quire.conformance.end_to_end import single_platform_registry
from quire.conformance.pytest_plugin import judge
from quire.conformance.runner import CHECKS
from quire.conformance.report import CheckResult, Report
from quire.entrypoints.cli import conformance as cli_conformance
from quire.entrypoints.cli import main
from quire.entrypoints.cli.common import UsageError
from quire.platforms.cpu import CpuPlatform

DEVICE_CHECKS = ("memory profiler", "communicator", "end-to-end")


def test_kernels_only_runs_the_kernels_and_never_passes_a_device_check() -> None:
    report = run_conformance(CpuPlatform(), ConformanceOptions(
        kernels_only=True, dtypes=(torch.float32,), block_sizes=(16,)))
    assert (report.mode, report.device) == ("kernels-only", "cpu")
    outcomes = {r.check: r for r in report.results}
    for title in ("platform contract", "kv write", "paged attention"):
        assert outcomes[title].outcome is Outcome.PASS
    for title in DEVICE_CHECKS:
        assert outcomes[title].result_text == "not run: kernels-only mode"
    assert report.exit_code(require_available=True) == 0


def test_kernels_only_without_a_buildable_backend_is_not_available_not_failed() -> None:
    class NoKernelsHere(broken.Absent):
        def make_attention_backend(self):
            raise ImportError("No module named 'vendor_kernels'")

    report = run_conformance(NoKernelsHere(), ConformanceOptions(kernels_only=True))
    rows = {r.check: r for r in report.results}
    assert rows["kv write"].outcome is Outcome.NOT_AVAILABLE
    assert "make_attention_backend() raised ImportError" in rows["kv write"].reason
    assert not report.failed
    assert report.exit_code() == 0 and report.exit_code(require_available=True) == 1


def test_unavailable_platform_reports_its_reason_and_does_not_fail() -> None:
    report = run_conformance(broken.Absent())
    assert report.mode == "unavailable" and report.unavailable_reason == "no absent device here"
    contract, *rest = report.results
    assert contract.outcome is Outcome.PASS  # needs no device, so it runs
    assert [r.result_text for r in rest] == ["not available: no absent device here"] * (
        len(CHECKS) - 1)
    assert report.exit_code() == 0
    assert report.exit_code(require_available=True) == 1


def test_dtypes_must_be_declared_and_options_are_checked() -> None:
    class Bf16Only(CpuPlatform):
        supported_dtypes = (torch.bfloat16,)

    with pytest.raises(ValueError, match="does not declare float32; it declares bfloat16"):
        run_conformance(Bf16Only(), ConformanceOptions(dtypes=(torch.float32,)))
    with pytest.raises(ValueError, match="unknown check"):
        ConformanceOptions(checks=("speed",))
    with pytest.raises(ValueError, match="block sizes"):
        ConformanceOptions(block_sizes=(0,))


def test_a_refused_optional_block_size_is_not_run_a_refused_default_fails() -> None:
    class OnlyBlock16(broken.ReferenceAttentionBackend):
        def build_metadata(self, batch):
            if batch.block_size != 16:
                raise ValueError(f"block size {batch.block_size} is not supported")
            return super().build_metadata(batch)

    platform = broken.platform_with(OnlyBlock16)
    options = {"checks": ("attention",), "dtypes": (torch.float32,)}
    ok, refused = run_conformance(platform, ConformanceOptions(block_sizes=(16, 3), **options),
                                  expected_name="cpu").results
    assert ok.outcome is Outcome.PASS and ok.figure.endswith("; 20 cases")
    assert refused.outcome is Outcome.NOT_RUN and "block size 3 is not supported" in refused.reason
    [required] = run_conformance(platform, ConformanceOptions(block_sizes=(3,), **options),
                                 expected_name="cpu").results
    assert required.outcome is Outcome.FAIL and "are required" in required.reason


def test_report_table_and_exit_codes() -> None:
    rows = (
        CheckResult("a", Outcome.PASS, figure="fine"),
        CheckResult("b", Outcome.NOT_RUN, "x", "kernels-only mode"),
    )
    report = Report("p", "kernels-only", "cpu", rows)
    assert report.table() == [
        "CHECK  RESULT                      FIGURE",
        "a      pass                        fine",
        "b [x]  not run: kernels-only mode",
    ]
    assert report.summary() == "p (kernels-only): 1 pass, 1 not run"
    assert report.exit_code(require_available=True) == 0
    failed = Report("p", "full", "cpu", rows + (CheckResult("c", Outcome.FAIL, reason="bad"),))
    assert failed.exit_code() == 1
    with pytest.raises(ValueError, match="must say why"):
        CheckResult("d", Outcome.FAIL)


def test_pytest_verdicts() -> None:
    unavailable = Report("p", "unavailable", "-",
                         (CheckResult("a", Outcome.NOT_AVAILABLE, reason="no device"),))
    assert judge(unavailable, require_available=False) == (Outcome.NOT_AVAILABLE,
                                                           "not available: no device")
    assert judge(unavailable, require_available=True)[0] is Outcome.FAIL
    not_run = Report("p", "kernels-only", "cpu",
                     (CheckResult("a", Outcome.NOT_RUN, reason="kernels-only mode"),))
    assert judge(not_run, require_available=True) == (Outcome.NOT_RUN,
                                                      "not run: kernels-only mode")
    mixed = Report("p", "full", "cpu", (CheckResult("a", Outcome.PASS),
                                        CheckResult("b", Outcome.NOT_RUN, reason="1 device")))
    assert judge(mixed, require_available=True) is None


# -- the command line ------------------------------------------------------------------------


def test_cli_check_ids_match_the_suite() -> None:
    assert cli_conformance._CHECK_IDS == CHECK_IDS


def test_cli_prints_the_table_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["conformance", "--device", "cpu", "--check", "platform",
                 "--check", "memory"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "quire conformance: platform 'cpu', mode full, device cpu"
    assert out[1].split() == ["CHECK", "RESULT", "FIGURE"]
    assert out[2].startswith("platform contract  pass")
    assert out[3].startswith("memory profiler    pass")
    assert out[4] == "cpu (full): 2 pass"


def test_cli_unavailable_platform_exits_0_unless_required(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli_conformance, "open_registry",
                        lambda args: single_platform_registry(broken.Absent()))
    assert main(["conformance", "--device", "absent"]) == 0
    out = capsys.readouterr().out
    assert "kv write           not available: no absent device here" in out
    assert out.splitlines()[-1] == (
        "platform 'absent' is not available here: no absent device here; nothing that needs "
        "it was run (exit status 0; pass --require-available to make this an error)")
    assert main(["conformance", "--device", "absent", "--require-available"]) == 1


def test_cli_failure_exits_1(monkeypatch: pytest.MonkeyPatch,
                             capsys: pytest.CaptureFixture[str]) -> None:
    platform = broken.platform_with(broken.SwappedKeysAndValues)
    monkeypatch.setattr(cli_conformance, "open_registry",
                        lambda args: single_platform_registry(platform))
    assert main(["conformance", "--device", "cpu", "--check", "kv-write",
                 "--dtype", "float32"]) == 1
    assert "kv write [float32, block 16]  FAIL: step A" in capsys.readouterr().out


def test_cli_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["conformance", "--device", "nope"]) == 2
    assert "unknown device 'nope'" in capsys.readouterr().err
    assert main(["conformance", "--device", "cpu", "--dtype", "float64"]) == 2
    assert "--dtype: dtype must be" in capsys.readouterr().err


def test_cli_kernels_only_sets_triton_interpret() -> None:
    """In a fresh interpreter: triton must not be imported yet, and taking it out of this
    process's ``sys.modules`` would leave two copies of it (its submodules stay)."""
    probe = (
        "import os\n"
        "from quire.entrypoints.cli import main\n"
        "rc = main(['conformance', '--device', 'cpu', '--kernels-only', '--check', 'memory'])\n"
        "print('rc', rc, 'TRITON_INTERPRET', os.environ.get('TRITON_INTERPRET'))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "rc 0 TRITON_INTERPRET 1" in result.stdout
    assert "memory profiler  not run: kernels-only mode" in result.stdout


def test_triton_interpreter_must_be_set_before_triton_is_imported() -> None:
    env: dict[str, str] = {}
    cli_conformance.enable_triton_interpreter(env, triton_imported=False)
    assert env == {"TRITON_INTERPRET": "1"}
    cli_conformance.enable_triton_interpreter(env, triton_imported=True)  # already on: fine
    with pytest.raises(UsageError, match="triton was imported before TRITON_INTERPRET=1"):
        cli_conformance.enable_triton_interpreter({}, triton_imported=True)
