"""The cpu platform's thread count: cores from affinity and cgroup quota, user overrides."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from quire.platforms.cpu import threads
from quire.platforms.cpu.platform import CpuPlatform
from quire.platforms.cpu.threads import THREADS_ENV, available_cores, choose_num_threads

AFFINITY = len(os.sched_getaffinity(0))


def _cgroup(tmp_path: Path, cpu_max: str | None) -> Path:
    if cpu_max is not None:
        (tmp_path / "cpu.max").write_text(cpu_max + "\n")
    return tmp_path


@pytest.mark.parametrize(
    "cpu_max,expected",
    [
        (None, AFFINITY),  # no cgroup file: the affinity mask
        ("max 100000", AFFINITY),  # unlimited
        ("100000 100000", 1),  # one CPU's worth
        ("150000 100000", min(2, AFFINITY)),  # 1.5 CPUs round up
        ("5000 100000", 1),  # never below one
        ("garbage", AFFINITY),
    ],
)
def test_available_cores(tmp_path: Path, cpu_max: str | None, expected: int) -> None:
    assert available_cores(_cgroup(tmp_path, cpu_max)) == expected


def test_the_environment_variable_wins(tmp_path: Path) -> None:
    cgroup = _cgroup(tmp_path, "100000 100000")
    env = {THREADS_ENV: "3", "OMP_NUM_THREADS": "7"}
    assert choose_num_threads(env, current=AFFINITY, cgroup=cgroup) == 3
    for bad in ("0", "-2", "two", ""):
        with pytest.raises(ValueError, match=THREADS_ENV):
            choose_num_threads({THREADS_ENV: bad}, current=AFFINITY, cgroup=cgroup)


def test_explicit_user_settings_are_left_alone(tmp_path: Path) -> None:
    cgroup = _cgroup(tmp_path, "100000 100000")
    assert choose_num_threads({"OMP_NUM_THREADS": "4"}, AFFINITY, cgroup) is None
    assert choose_num_threads({"MKL_NUM_THREADS": "4"}, AFFINITY, cgroup) is None
    # torch.set_num_threads was called: torch is no longer at its default
    assert choose_num_threads({}, AFFINITY + 1, cgroup) is None


def test_the_default_is_the_quota_capped_affinity(tmp_path: Path) -> None:
    (tmp_path / "quota").mkdir()
    (tmp_path / "none").mkdir()
    assert choose_num_threads({}, AFFINITY, _cgroup(tmp_path / "quota", "100000 100000")) == 1
    assert choose_num_threads({}, AFFINITY, _cgroup(tmp_path / "none", None)) == AFFINITY


def test_the_platform_applies_it_at_engine_start(monkeypatch: pytest.MonkeyPatch) -> None:
    before = torch.get_num_threads()
    try:
        monkeypatch.setenv(THREADS_ENV, "1")
        CpuPlatform().configure_process()
        assert torch.get_num_threads() == 1
        monkeypatch.delenv(THREADS_ENV)
        monkeypatch.setattr(threads, "choose_num_threads", lambda env, current: None)
        CpuPlatform().configure_process()  # nothing chosen: nothing changes
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_single_token_steps_run_on_one_thread() -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        steps = threads.StepThreads(2)
        steps.begin_step(1)
        assert torch.get_num_threads() == 1
        steps.begin_step(1)
        assert torch.get_num_threads() == 1
        steps.begin_step(2)
        assert torch.get_num_threads() == 2
        steps.begin_step(2048)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_the_platform_switches_per_step_only_with_passive_waiting_and_its_own_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = torch.get_num_threads()
    try:
        monkeypatch.setattr(threads, "choose_num_threads", lambda env, current: 2)
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
        platform = CpuPlatform()
        platform.configure_process()
        platform.begin_step(1)  # spinning threads (libgomp's default): keep both
        assert torch.get_num_threads() == 2

        monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
        platform = CpuPlatform()
        platform.begin_step(1)  # before configure_process: nothing to switch
        platform.configure_process()
        platform.begin_step(1)
        assert torch.get_num_threads() == 1
        platform.begin_step(64)
        assert torch.get_num_threads() == 2

        monkeypatch.setenv(THREADS_ENV, "2")  # the user's count holds for every step
        platform = CpuPlatform()
        platform.configure_process()
        platform.begin_step(1)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
