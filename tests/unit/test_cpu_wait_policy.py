"""How OpenMP threads wait on a shared host: the decision as a pure function of (cores,
load, option), the load sampled from /proc/stat, and the engine processes Quire starts
getting it before torch loads."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from quire.config import EngineConfig
from quire.engine import core_proc
from quire.executor import multiproc
from quire.interfaces.attention import AttentionBackend
from quire.interfaces.communicator import Communicator
from quire.interfaces.memory import MemoryProfiler
from quire.interfaces.platform import Availability, Platform
from quire.platforms.cpu import threads
from quire.platforms.cpu.options import CpuOptions
from quire.platforms.cpu.threads import (
    WAIT_ENV,
    CpuTimes,
    choose_wait_policy,
    host_load,
    host_wait_policy,
    sample_busy_cpus,
    wait_environment,
)


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


def test_the_cpu_platforms_child_environment_reads_the_host_and_the_option(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from quire.platforms.cpu.platform import CpuPlatform

    monkeypatch.setattr(threads, "available_cores", lambda: 2)
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(threads, "host_load", lambda: 1.5)
    platform = CpuPlatform()  # not configured: the hook takes the options itself
    with caplog.at_level("INFO", logger=threads.__name__):
        assert platform.child_environment({}, {}) == {WAIT_ENV: "PASSIVE"}
    assert "wait passively (load 1.50" in caplog.text
    assert wait_environment("auto", {}) == {WAIT_ENV: "PASSIVE"}
    assert platform.child_environment({"wait_policy": "spin", "isa": "avx2"}, {}) == {}
    assert platform.child_environment({}, {"QUIRE_CPU_WAIT_POLICY": "spin"}) == {}
    assert platform.child_environment({}, {WAIT_ENV: "ACTIVE"}) == {}
    with pytest.raises(ValueError, match="platform option wait_policy"):
        platform.child_environment({"wait_policy": "never"}, {})
    with pytest.raises(ValueError, match="unknown cpu option"):
        platform.child_environment({"waitpolicy": "passive"}, {})


class _Bare(Platform):
    """A platform with none of the optional hooks (as one built for API 1.1)."""

    name, device_type, distributed_backend = "bare", "cpu", "gloo"
    supported_dtypes, default_block_size = (torch.float32,), 16

    def availability(self) -> Availability:
        return Availability.yes()

    def make_attention_backend(self) -> AttentionBackend:
        raise NotImplementedError

    def make_communicator(self, rank: int = 0, world_size: int = 1,
                          group: object | None = None) -> Communicator:
        raise NotImplementedError

    def make_memory_profiler(self, device_index: int = 0) -> MemoryProfiler:
        raise NotImplementedError


def test_another_platform_adds_nothing_to_its_processes_environment() -> None:
    """The hook's default (plugin API 1.2) puts nothing into the environment, whatever
    options it is given."""
    assert _Bare().child_environment({"wait_policy": "passive"}, {}) == {}


def _stat(*cpus: tuple[int, ...]) -> str:
    """A /proc/stat of these CPUs' tick counts (user nice system idle iowait irq softirq
    steal guest guest_nice), the ``cpu`` line their sum, as Linux writes it."""
    summed = [sum(column) for column in zip(*cpus)]
    lines = ["cpu  " + " ".join(map(str, summed))]
    lines += [f"cpu{i} " + " ".join(map(str, ticks)) for i, ticks in enumerate(cpus)]
    return "\n".join(lines + ["intr 1 2 3", "ctxt 99", "procs_running 3", ""])


#: 2 CPUs after some uptime
_IDLE = _stat((500, 10, 200, 9000, 30, 0, 5, 0, 0, 0), (400, 0, 100, 9200, 10, 0, 3, 0, 0, 0))
#: 100 ticks per CPU later: cpu0 busy 60 (user, of it 20 a guest's: counted once), system
#: 10, steal 10), idle 20; cpu1 idle 90, iowait 10 (waiting on a disk is not busy)
_LATER = _stat((560, 10, 210, 9020, 30, 0, 5, 10, 20, 0),
               (400, 0, 100, 9290, 20, 0, 3, 0, 0, 0))


def test_a_proc_stat_reading_counts_busy_ticks_and_online_cpus() -> None:
    before, after = CpuTimes.parse(_IDLE), CpuTimes.parse(_LATER)
    assert (after.cpus, after.total - before.total) == (2, 200)
    assert after.busy - before.busy == 80
    assert after.busy_cpus_since(before) == pytest.approx(0.8)
    assert after.busy_cpus_since(before, own_ticks=30) == pytest.approx(0.5)  # ours: not
    assert after.busy_cpus_since(before, own_ticks=500) == 0.0
    assert before.busy_cpus_since(before) is None  # no tick passed
    with pytest.raises(ValueError, match="no 'cpu' line"):
        CpuTimes.parse("intr 1 2 3\n")


def test_the_sampler_reads_proc_stat_twice_and_gives_the_busy_cpus() -> None:
    readings = iter([_IDLE, _LATER])
    busy = sample_busy_cpus(lambda: next(readings), seconds=0.0)
    # less this process's own ticks over the (empty) window: at most one clock tick
    assert busy == pytest.approx(0.8, abs=0.02)
    assert next(readings, None) is None


def test_an_idle_host_right_after_a_benchmark_is_idle(monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """The 1-minute load average still says 2 (a benchmark just ended); /proc/stat says
    0.8 CPUs of 2 are busy now. Without /proc/stat (macOS) the load average it is."""
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (2.0, 1.0, 0.5))
    readings = iter([_IDLE, _LATER])
    assert host_load(lambda: next(readings), seconds=0.0) == pytest.approx(0.8, abs=0.02)

    def no_proc() -> str:
        raise FileNotFoundError("/proc/stat")

    assert host_load(no_proc) == 2.0
    with caplog.at_level("WARNING", logger=threads.__name__):
        assert host_load(lambda: "cpu 1 2\n") == 2.0
    assert "no 'cpu' line" in caplog.text
    idle = iter([_IDLE, _stat((500, 10, 200, 9100, 30, 0, 5, 0, 0, 0),
                              (400, 0, 100, 9300, 10, 0, 3, 0, 0, 0))])
    decision = host_wait_policy("auto", {}, lambda: host_load(lambda: next(idle), 0.0))
    assert decision.policy == "spin", decision.reason


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="no /proc/stat (not Linux)")
def test_this_hosts_proc_stat_gives_a_figure_between_none_and_every_cpu() -> None:
    busy = sample_busy_cpus(seconds=0.05)
    assert busy is not None and 0.0 <= busy <= os.cpu_count()


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


def test_the_core_processes_ask_the_platform_the_device_resolves_to(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Resolved in the starting process, so a device that cannot run starts nothing."""
    _Recorded.calls.clear()
    monkeypatch.setattr(core_proc.subprocess, "Popen", _Recorded)
    with pytest.raises(ValueError, match="nosuch"):
        core_proc.CoreProcesses(EngineConfig(model="unused", device="nosuch"))
    with pytest.raises(ValueError, match="platform option wait_policy"):
        core_proc.CoreProcesses(EngineConfig(model="unused", device="cpu",
                                             platform_options={"wait_policy": "never"}))
    assert _Recorded.calls == []


def test_mp_workers_start_with_what_the_engines_platform_asks_for(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The executor asks the platform it was given, not the cpu platform's module."""

    class Asks(_Bare):
        def child_environment(self, options, env):  # type: ignore[no-untyped-def]
            assert options == {"knob": 1} and env is os.environ
            return {"QUIRE_TEST_CHILD": "set"}

    _Recorded.calls.clear()
    monkeypatch.setattr(multiproc.subprocess, "Popen", _Recorded)
    config = EngineConfig(model="unused", device="cpu", platform_options={"knob": 1},
                          tensor_parallel_size=2)
    with pytest.raises(multiproc.WorkerDied, match="exit code 0"):  # _Recorded "exits"
        multiproc.MultiprocExecutor(config, 2, Asks())
    assert [c["env"] for c in _Recorded.calls] == [{**os.environ, "QUIRE_TEST_CHILD": "set"}] * 2


def test_an_in_process_engine_that_cannot_apply_passive_waiting_says_how(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from quire.platforms.cpu.platform import CpuPlatform

    monkeypatch.delenv(WAIT_ENV, raising=False)
    platform = CpuPlatform()
    platform.configure({"wait_policy": "passive", "threads": torch.get_num_threads()})
    with caplog.at_level("DEBUG"):
        platform.configure_process()
    # a one-line hint the user of quire generate or LLM(...) can act on, no warning
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    hints = [r.getMessage() for r in caplog.records if r.levelname == "INFO"
             and f"{WAIT_ENV}=PASSIVE set before the command starts" in r.getMessage()]
    assert len(hints) == 1 and "\n" not in hints[0]
    assert any("the wait_policy option" in r.getMessage() for r in caplog.records
               if r.levelname == "DEBUG")
    caplog.clear()
    monkeypatch.setenv(WAIT_ENV, "PASSIVE")  # as a process Quire started has it
    with caplog.at_level("DEBUG"):
        platform.configure_process()
    assert WAIT_ENV not in caplog.text


def test_the_auto_hint_samples_the_host_beside_the_loading_not_before_it(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """``auto`` in a process already loaded spinning: the host's load is sampled on a
    thread of its own, so configure_process returns before the sample ends, and the
    hint follows once it does. Where the decision needs no sample (the user's variable,
    an explicit option) nothing samples at all."""
    import threading

    from quire.platforms.cpu.platform import CpuPlatform

    monkeypatch.delenv(WAIT_ENV, raising=False)
    release, sampled = threading.Event(), []

    def slow_busy_host() -> float:
        sampled.append(threading.current_thread().name)
        assert release.wait(30)
        return 64.0  # every CPU busy: passive waiting wanted

    monkeypatch.setattr(threads, "host_load", slow_busy_host)
    platform = CpuPlatform()
    platform.configure({"threads": torch.get_num_threads()})  # wait_policy auto
    with caplog.at_level("INFO"):
        platform.configure_process()  # returns while the sample waits
        assert not [r for r in caplog.records if WAIT_ENV in r.getMessage()]
        release.set()
        for thread in threading.enumerate():
            if thread.name == "quire-wait-hint":
                thread.join(30)
    assert sampled == ["quire-wait-hint"]
    assert [r for r in caplog.records if f"{WAIT_ENV}=PASSIVE set before" in r.getMessage()]
    for env, option in (({WAIT_ENV: "active"}, "auto"), ({}, "spin"), ({}, "passive")):
        assert threads.host_wait_policy(option, env).policy in ("spin", "passive")
    assert sampled == ["quire-wait-hint"]  # none of those sampled


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_data_parallel_cores_on_the_cpu_each_get_their_share_of_its_cores(
        monkeypatch: pytest.MonkeyPatch, device: str) -> None:
    """Pinned by the platform the device resolves to: ``auto`` on a host without an
    accelerator is the cpu too, and two unpinned replicas would oversubscribe it."""
    _Recorded.calls.clear()
    monkeypatch.setattr(core_proc.subprocess, "Popen", _Recorded)
    monkeypatch.setattr(core_proc, "cores_of", lambda rank, count: [rank])
    registry = core_proc.PlatformRegistry()
    if registry.resolve(device).device_type != "cpu":
        pytest.skip(f"device={device} resolves to an accelerator here")
    procs = core_proc.CoreProcesses(EngineConfig(model="unused", device=device,
                                                 data_parallel_size=2))
    procs.stop()
    scripts = [call["args"][2] for call in _Recorded.calls]
    assert ["cores = [0]" in scripts[0], "cores = [1]" in scripts[1]] == [True, True]


def test_the_cores_of_several_models_wait_passively_unless_the_user_says(
        monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """A core with a slot in a shared KV budget (one of several models on this host)
    starts with OpenMP threads that sleep when idle, so a busy model gets the CPUs an
    idle one leaves; a wait policy the user set is left as it is."""
    from quire.engine.kv_budget import KVLedger, KVShareSpec

    KVLedger.create(str(tmp_path / "ledger"), 2).close()
    share = KVShareSpec(str(tmp_path / "ledger"), 1)
    config = EngineConfig(model="unused", device="cpu")
    for user, wanted in ((None, "PASSIVE"), ("ACTIVE", "ACTIVE")):
        _Recorded.calls.clear()
        with monkeypatch.context() as patched:
            patched.setattr(core_proc.subprocess, "Popen", _Recorded)
            if user is not None:
                patched.setenv(WAIT_ENV, user)
            else:
                patched.delenv(WAIT_ENV, raising=False)
            core_proc.CoreProcesses(config, kv_share=share).stop()
        (call,) = _Recorded.calls
        assert call["env"][WAIT_ENV] == wanted
