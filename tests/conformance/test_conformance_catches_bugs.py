"""A conformance suite that cannot fail is worthless: each check against a platform with
one deliberate bug (tests/conformance/broken_platforms.py) must report FAIL, saying why.

Kernel checks run in float32 at one block size here, to stay fast; the bugs are far
outside every dtype's tolerance (errors of order 1, or NaN).
"""

from __future__ import annotations

import pytest
import torch

from quire.conformance import CheckResult, ConformanceOptions, Outcome, run_conformance
from quire.interfaces.platform import Platform

import broken_platforms as broken

QUICK = {"dtypes": (torch.float32,), "block_sizes": (16,)}


def failures(platform: Platform, check: str, **options) -> list[str]:
    report = run_conformance(platform, ConformanceOptions(checks=(check,), **options),
                             expected_name="cpu")
    assert report.exit_code() == (1 if report.failed else 0)
    return [r.reason for r in report.results if r.outcome is Outcome.FAIL]


@pytest.mark.parametrize(
    ("platform", "why"),
    [
        (broken.ZeroBlockSize(), "default_block_size 0 is not an int >= 1"),
        (broken.AcceptsAnyDtype(), "check_dtype accepts torch.float64"),
        (broken.AvailabilityIsABool(), "availability() returned True, not an Availability"),
        (broken.Absent(), "name 'absent' is not the requested 'cpu'"),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, Platform) else "",
)
def test_platform_contract_catches(platform: Platform, why: str) -> None:
    [reason] = failures(platform, "platform")
    assert why in reason


@pytest.mark.parametrize(
    ("backend", "why"),
    [
        (broken.ShiftedWrite, "reading the written values back"),
        (broken.SwappedKeysAndValues, "reading the written values back"),
        (broken.ClobberingWrite, "write_kv changed 14336 cache elements, expected 13568"),
        (broken.WrongKvHead, "reading the written values back"),
    ],
    ids=lambda v: v.__name__ if isinstance(v, type) else "",
)
def test_kv_write_catches(backend: type, why: str) -> None:
    [reason] = failures(broken.platform_with(backend), "kv-write", **QUICK)
    assert why in reason


@pytest.mark.parametrize(
    ("backend", "why"),
    [
        (broken.NoCausalMask, "prefill"),
        (broken.WrongKvHead, "gqa"),
        (broken.IgnoresWindow, "window"),
        (broken.IgnoresSoftCap, "softcap"),
        (broken.ReadsUnwrittenSlots, "non-finite"),
    ],
    ids=lambda v: v.__name__ if isinstance(v, type) else "",
)
def test_paged_attention_catches(backend: type, why: str) -> None:
    [reason] = failures(broken.platform_with(backend), "attention", **QUICK)
    assert why in reason and "max |err|" in reason


def test_paged_attention_catches_a_missing_soft_cap_at_the_loosest_tolerance() -> None:
    """bfloat16's tolerance still leaves the soft cap's effect far outside it."""
    [reason] = failures(broken.platform_with(broken.IgnoresSoftCap), "attention",
                        dtypes=(torch.bfloat16,), block_sizes=(16,))
    assert "softcap" in reason


@pytest.mark.parametrize(
    ("platform", "why"),
    [
        (broken.FreeAboveTotalPlatform(), "readings violate 0 < free <= total"),
        (broken.FlatPeakPlatform(), "the peak rose by 0 bytes after 67108864 bytes"),
        (broken.OverGrantsFractionPlatform(), "kv_budget(0.5)="),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, Platform) else "",
)
def test_memory_profiler_catches(platform: Platform, why: str) -> None:
    [reason] = failures(platform, "memory")
    assert why in reason


def test_memory_check_tolerates_free_memory_moving_between_readings() -> None:
    """A CI run once failed the cpu platform on 30 KiB of free memory that came and went."""
    assert failures(broken.JitteryFreePlatform(), "memory") == []


def communicator_rows(platform: Platform) -> dict[str, CheckResult]:
    report = run_conformance(platform, ConformanceOptions(checks=("communicator",)))
    return {row.case: row for row in report.results}


@pytest.fixture
def one_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """World size 1 only: the spawned world sizes are the slow tests below."""
    from quire.conformance import collectives

    monkeypatch.setattr(collectives, "device_count", lambda platform: 1)


@pytest.fixture
def two_ranks_at_most(monkeypatch: pytest.MonkeyPatch) -> None:
    """Spawn world size 2 only (read in this process: the ranks never see it)."""
    from quire.conformance import collectives

    monkeypatch.setattr(collectives, "SPAWNED_WORLD_SIZES", (2,))


def test_communicator_catches_at_world_size_1(one_device: None) -> None:
    rows = communicator_rows(broken.DoublingAllReducePlatform())
    assert list(rows) == ["world size 1", "world size 1, send/recv", "world size 2",
                          "world size 4"]
    assert rows["world size 1"].outcome is Outcome.FAIL
    assert "all_reduce differs" in rows["world size 1"].reason
    assert rows["world size 1, send/recv"].outcome is Outcome.PASS
    for n in (2, 4):
        row = rows[f"world size {n}"]
        assert row.outcome is Outcome.NOT_RUN and f"needs {n} 'cpu' devices, found 1" in row.reason


def test_send_and_recv_must_refuse_at_world_size_1(one_device: None) -> None:
    row = communicator_rows(broken.SendsWithoutPeerPlatform())["world size 1, send/recv"]
    assert row.outcome is Outcome.FAIL
    for call in ("send(dst=0)", "recv(src=0)", "send(dst=1)", "recv(src=1)"):
        assert f"{call} on rank 0 of 1 returned, expected ValueError" in row.reason


def test_a_plugin_api_1_0_communicator_is_not_run_for_send_recv(one_device: None) -> None:
    rows = communicator_rows(broken.CollectivesOnlyPlatform())
    assert rows["world size 1"].outcome is Outcome.PASS
    row = rows["world size 1, send/recv"]
    assert row.outcome is Outcome.NOT_RUN
    assert "does not implement send/recv (added in plugin API 1.1)" in row.reason


@pytest.mark.slow
def test_communicator_catches_at_world_size_2(two_ranks_at_most: None) -> None:
    """All-gather in the wrong rank order is invisible at world size 1."""
    rows = communicator_rows(broken.ReversedAllGatherPlatform())
    assert rows["world size 1"].outcome is Outcome.PASS
    ws2 = rows["world size 2"]
    assert ws2.outcome is Outcome.FAIL
    assert "rank 0: all_gather(dim=0) differs" in ws2.reason
    assert "rank 1: all_gather(dim=-1) differs" in ws2.reason
    assert rows["world size 2, send/recv"].outcome is Outcome.PASS


@pytest.mark.slow
def test_send_recv_catches_a_corrupting_send_at_world_size_2(two_ranks_at_most: None) -> None:
    rows = communicator_rows(broken.CorruptingSendPlatform())
    assert rows["world size 1, send/recv"].outcome is Outcome.PASS  # nothing is sent there
    assert rows["world size 2"].outcome is Outcome.PASS
    p2p = rows["world size 2, send/recv"]
    assert p2p.outcome is Outcome.FAIL
    for found in ("rank 0: ring in float32: recv(src=1): 165 of 165 elements differ",
                  "rank 1: ring in bfloat16: recv(src=0)",
                  "rank 1: pipeline hidden states", "rank 1: pipeline residual"):
        assert found in p2p.reason


@pytest.mark.slow
def test_a_plugin_api_1_0_communicator_still_runs_its_collectives_at_world_size_2(
    two_ranks_at_most: None,
) -> None:
    rows = communicator_rows(broken.CollectivesOnlyPlatform())
    assert rows["world size 2"].outcome is Outcome.PASS
    assert rows["world size 2, send/recv"].outcome is Outcome.NOT_RUN


def test_end_to_end_catches_a_wrong_kv_head() -> None:
    reasons = failures(broken.platform_with(broken.WrongKvHead), "end-to-end")
    assert "differs at token" in reasons[0] and "cpu gave" in reasons[0]
    # the half dtypes' rows, against float32, catch it too
    assert len(reasons) == 3
    assert all("top-1 agreement" in r or "logprob" in r for r in reasons[1:])


def test_an_exception_in_a_check_is_a_failure_not_a_crash() -> None:
    class Raising(broken.WithBackend):
        def make_memory_profiler(self, device_index=0):
            raise OSError("no /proc here")

    [reason] = failures(Raising(), "memory")
    assert reason == "raised OSError: no /proc here"
