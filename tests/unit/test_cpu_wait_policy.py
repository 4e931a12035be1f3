"""How OpenMP threads wait on a shared host: the decision as a pure function of (cores,
load, option), and the engine processes Quire starts getting it before torch loads."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from quire.config import EngineConfig
from quire.engine import core_proc
from quire.platforms.cpu import threads
from quire.platforms.cpu.options import CpuOptions
from quire.platforms.cpu.threads import WAIT_ENV, choose_wait_policy, wait_environment


@pytest.mark.parametrize(("option", "cores", "host_cores", "load", "policy"), [
    ("auto", 2, 2, 0.2, "spin"),       # an idle 2-core host: spinning is 15-40% faster
    ("auto", 2, 2, 1.0, "passive"),    # one other busy process on it: passive, 1.6-4x
    ("auto", 64, 64, 8.0, "spin"),     # 8 busy threads spread over 64 cores
    ("auto", 64, 64, 16.0, "passive"),
    ("auto", 8, 64, 8.0, "spin"),      # the host is busy, but ~1 of it on our 8 cores
    ("auto", 8, 64, 40.0, "passive"),
    ("auto", 1, 1, 0.0, "spin"),
    ("spin", 2, 2, 4.0, "spin"),       # the option wins over the load
    ("passive", 64, 64, 0.0, "passive"),
])
def test_the_decision_is_a_function_of_cores_load_and_option(
        option: str, cores: int, host_cores: int, load: float, policy: str) -> None:
    decision = choose_wait_policy(option, cores, host_cores, load)
    assert decision.policy == policy
    assert decision.environment() == ({WAIT_ENV: "PASSIVE"} if policy == "passive" else {})
    assert decision.reason  # logged


def test_the_users_omp_wait_policy_wins_and_is_inherited() -> None:
    passive = choose_wait_policy("spin", 2, 2, 0.0, user="passive")
    assert (passive.policy, passive.user_set) == ("passive", True)
    assert passive.environment() == {}  # the started process inherits it as it is
    assert "OMP_WAIT_POLICY=passive" in passive.reason
    assert choose_wait_policy("passive", 2, 2, 4.0, user="ACTIVE").policy == "spin"
    with pytest.raises(ValueError, match="wait_policy='sleepy'"):
        choose_wait_policy("sleepy", 2, 2, 0.0)


def test_the_option_is_typed_and_may_come_from_its_variable() -> None:
    assert CpuOptions().wait_policy == "auto"
    assert CpuOptions.parse({"wait_policy": "Passive"}, {}).wait_policy == "passive"
    assert CpuOptions.parse({}, {"QUIRE_CPU_WAIT_POLICY": "spin"}).wait_policy == "spin"
    with pytest.raises(ValueError, match="wait_policy"):
        CpuOptions(wait_policy="active")


def test_the_environment_reads_the_host_and_the_option(monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(threads, "available_cores", lambda: 2)
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(threads, "_load_average", lambda: 1.5)
    with caplog.at_level("INFO", logger=threads.__name__):
        assert wait_environment("cpu", None, {}) == {WAIT_ENV: "PASSIVE"}
    assert "wait passively (load 1.50" in caplog.text
    assert wait_environment("cpu", {"wait_policy": "spin", "isa": "avx2"}, {}) == {}
    assert wait_environment("auto", None, {"QUIRE_CPU_WAIT_POLICY": "spin"}) == {}
    assert wait_environment("cpu", None, {WAIT_ENV: "ACTIVE"}) == {}
    assert wait_environment("cuda", {"wait_policy": "passive"}, {}) == {}  # not ours
    with pytest.raises(ValueError, match="platform option wait_policy"):
        wait_environment("cpu", {"wait_policy": "never"}, {})


class _Recorded:
    """A Popen that records its arguments and never runs."""

    calls: list[dict] = []

    def __init__(self, args: list[str], **kwargs: object) -> None:
        self.calls.append({"args": args, **kwargs})
        self.pid = 0

    def poll(self) -> int:
        return 0

    def wait(self, timeout: float | None = None) -> int:
        return 0


def test_an_engine_core_process_starts_with_the_setting_and_openmp_reads_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(WAIT_ENV, raising=False)
    _Recorded.calls.clear()
    with monkeypatch.context() as patched:  # subprocess is one module: undo before run
        patched.setattr(core_proc.subprocess, "Popen", _Recorded)
        procs = core_proc.CoreProcesses(EngineConfig(
            model="unused", device="cpu", platform_options={"wait_policy": "passive"}))
        procs.stop()
    (call,) = _Recorded.calls
    env = call["env"]
    assert env[WAIT_ENV] == "PASSIVE"
    # the process Quire starts has it before it imports torch, when libgomp reads it
    shown = subprocess.run(
        [sys.executable, "-c", "import torch; torch.ones(64, 64) @ torch.ones(64, 64)"],
        env={**env, "OMP_DISPLAY_ENV": "TRUE"}, capture_output=True, text=True,
        timeout=120, check=True)
    assert "OMP_WAIT_POLICY = 'PASSIVE'" in shown.stderr
    assert WAIT_ENV not in os.environ  # this process is left as it was


def test_an_in_process_engine_that_cannot_apply_passive_waiting_says_how(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import torch

    from quire.platforms.cpu.platform import CpuPlatform

    monkeypatch.delenv(WAIT_ENV, raising=False)
    platform = CpuPlatform()
    platform.configure({"wait_policy": "passive", "threads": torch.get_num_threads()})
    with caplog.at_level("WARNING"):
        platform.configure_process()
    assert f"set {WAIT_ENV}=PASSIVE before starting Python" in caplog.text
    caplog.clear()
    monkeypatch.setenv(WAIT_ENV, "PASSIVE")  # as a process Quire started has it
    with caplog.at_level("WARNING"):
        platform.configure_process()
    assert WAIT_ENV not in caplog.text
