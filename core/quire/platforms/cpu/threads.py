"""How many threads torch should use on this host, and setting it once at engine start.

torch's default is the CPUs the process may run on (its affinity mask), which ignores a
container's CPU quota (cgroup v2 ``cpu.max``): a 2-CPU quota on a 64-core host would get
64 threads that mostly wait for their turn. The count chosen here is the affinity mask
capped by that quota.

Precedence, first match wins:

1. ``QUIRE_CPU_THREADS=N``: exactly ``N`` threads.
2. ``OMP_NUM_THREADS`` or ``MKL_NUM_THREADS`` set, or torch already not at its default
   (someone called ``torch.set_num_threads``): the user chose; nothing is changed.
3. The cores available to the process (affinity, capped by the quota).

How idle threads wait between parallel regions is OpenMP's ``OMP_WAIT_POLICY``, which
libgomp reads once, when torch loads it. libgomp's default (spin a while, then sleep) is
15-40% faster on a host of its own; where other busy processes share the cores, spinning
threads steal from them and wait on the straggler, and passive waiting is 1.6-4x faster
(docs/bench.md, "Waiting on a shared host"). The ``wait_policy`` option chooses
(:func:`choose_wait_policy`; ``auto`` samples how busy the host's CPUs are,
:func:`host_load`) for the processes Quire starts: the platform's ``child_environment``
puts :func:`wait_environment` into an engine core's or a worker's environment before it
imports torch. A process that had torch loaded already (an in-process ``LLM``) keeps
what its environment said. With passive waiting, :class:`StepThreads` runs
single-token steps on one thread.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

#: Environment variable that fixes the thread count of the cpu platform.
THREADS_ENV = "QUIRE_CPU_THREADS"
_USER_THREAD_ENVS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
#: OpenMP's own variable: when set, it is the user's choice and wins over the option.
WAIT_ENV = "OMP_WAIT_POLICY"
#: CPUs kept busy by other processes, per core of ours (the host's figure spread evenly
#: over it), from which ``auto`` waits passively. Low on purpose: spinning on a busy
#: host costs 1.6-4x, passive waiting on an idle one 15-40%.
BUSY_LOAD_PER_CORE = 0.25
#: Seconds :func:`host_load` watches ``/proc/stat``: long enough for a few clock ticks
#: per CPU, short enough to add little to an engine's start.
LOAD_SAMPLE_S = 0.15


def available_cores(cgroup: str | os.PathLike[str] = "/sys/fs/cgroup") -> int:
    """CPUs in the affinity mask, capped by the cgroup v2 quota (rounded up), >= 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    quota = _cgroup_cpu_quota(Path(cgroup))
    if quota is not None:
        cores = min(cores, quota)
    return max(1, cores)


def choose_num_threads(
    env: Mapping[str, str], current: int, cgroup: str | os.PathLike[str] = "/sys/fs/cgroup"
) -> int | None:
    """The thread count to set, or None to leave torch as the user left it.

    :param env: the environment (``os.environ``).
    :param current: ``torch.get_num_threads()`` now.
    :raises ValueError: when ``QUIRE_CPU_THREADS`` is not a positive integer.
    """
    forced = env.get(THREADS_ENV)
    if forced is not None:
        if not forced.strip().isdigit() or int(forced) < 1:
            raise ValueError(f"{THREADS_ENV} must be a positive integer, got {forced!r}")
        return int(forced)
    if any(env.get(name) for name in _USER_THREAD_ENVS):
        return None
    if current != _affinity_count():  # not torch's default: set_num_threads was called
        return None
    return available_cores(cgroup)


def configure_threads(forced: int | None = None) -> int | None:
    """Apply :func:`choose_num_threads` to torch's intra-op pool (process-wide), once
    per engine process.

    :param forced: the platform's ``threads`` option: exactly that many.
    :returns: the count set, or None when the user's choice was left in place.
    """
    current = torch.get_num_threads()
    wanted = forced if forced is not None else choose_num_threads(os.environ, current)
    if wanted is not None and wanted != current:
        torch.set_num_threads(wanted)
    logger.info("cpu platform: %d torch threads", torch.get_num_threads())
    return wanted


@dataclass(frozen=True)
class WaitDecision:
    """How OpenMP threads are to wait, and why (for the log)."""

    #: ``spin`` (libgomp's default: spin a while, then sleep) or ``passive`` (sleep at once)
    policy: str
    reason: str
    #: the user's ``OMP_WAIT_POLICY``, which the processes started inherit unchanged
    user_set: bool = False

    def environment(self) -> dict[str, str]:
        """Variables to set in a process started to run the engine (before torch loads)."""
        return {WAIT_ENV: "PASSIVE"} if self.policy == "passive" and not self.user_set else {}


def choose_wait_policy(option: str, cores: int, host_cores: int, load: float,
                       user: str | None = None) -> WaitDecision:
    """The wait policy for an engine on ``cores`` of a host of ``host_cores`` on which
    other processes keep ``load`` CPUs busy (:func:`host_load`), decided before the
    engine runs. A pure function: :func:`host_wait_policy` reads the inputs.

    :param option: the ``wait_policy`` option: ``auto``, ``spin`` or ``passive``.
    :param user: ``OMP_WAIT_POLICY`` when set; it wins.
    :raises ValueError: on another ``option``.
    """
    if user:
        policy = "passive" if user.strip().upper() == "PASSIVE" else "spin"
        return WaitDecision(policy, f"{WAIT_ENV}={user} is set", user_set=True)
    if option in ("spin", "passive"):
        return WaitDecision(option, "the wait_policy option")
    if option != "auto":
        raise ValueError(f"cpu option wait_policy={option!r}: expected auto, spin or passive")
    on_ours = load * min(cores, host_cores) / max(1, host_cores)
    busy = on_ours >= BUSY_LOAD_PER_CORE * cores
    return WaitDecision(
        "passive" if busy else "spin",
        f"load {load:.2f} on the host's {host_cores} cores, ~{on_ours:.2f} of it on the "
        f"{cores} this engine may use: {'at or above' if busy else 'below'} "
        f"{BUSY_LOAD_PER_CORE} per core")


def host_wait_policy(option: str, env: Mapping[str, str],
                     load: Callable[[], float] | None = None) -> WaitDecision:
    """:func:`choose_wait_policy` for this host now (its cores, load and environment).

    :param load: what reads the load; :func:`host_load` by default, called only for
        ``auto`` without the user's ``OMP_WAIT_POLICY`` (it samples for a while).
    """
    user = env.get(WAIT_ENV)
    sampled = (load or host_load)() if option == "auto" and not user else 0.0
    return choose_wait_policy(option, available_cores(), os.cpu_count() or 1, sampled,
                              user)


@dataclass(frozen=True)
class CpuTimes:
    """The host's CPU time, in clock ticks, from the ``cpu`` line of ``/proc/stat``."""

    busy: int
    total: int
    #: online CPUs (the ``cpuN`` lines)
    cpus: int

    @classmethod
    def parse(cls, text: str) -> CpuTimes:
        """:raises ValueError: when ``text`` has no ``cpu`` line of at least 8 numbers."""
        lines = [line.split() for line in text.splitlines()]
        summed = next((f for f in lines if f and f[0] == "cpu"), None)
        if summed is None or len(summed) < 9 or not all(v.isdigit() for v in summed[1:]):
            raise ValueError("/proc/stat has no 'cpu' line of at least 8 tick counts")
        # user nice system idle iowait irq softirq steal [guest guest_nice: inside user, nice]
        ticks = [int(v) for v in summed[1:9]]
        cpus = sum(1 for f in lines if f and f[0].startswith("cpu") and f[0][3:].isdigit())
        return cls(busy=sum(ticks) - ticks[3] - ticks[4], total=sum(ticks),
                   cpus=max(1, cpus))

    def busy_cpus_since(self, before: CpuTimes, own_ticks: float = 0.0) -> float | None:
        """CPUs kept busy on average since ``before``, less ``own_ticks`` (this
        process's); None when no tick passed."""
        elapsed = self.total - before.total
        if elapsed <= 0:
            return None
        busy = max(0.0, self.busy - before.busy - own_ticks)
        return busy * self.cpus / elapsed


def sample_busy_cpus(read_stat: Callable[[], str] | None = None,
                     seconds: float = LOAD_SAMPLE_S) -> float | None:
    """CPUs other processes keep busy now: ``/proc/stat``'s busy ticks (user, nice,
    system, irq, softirq, steal; not idle or iowait) over ``seconds``, less this
    process's own, since what counts is what competes with the engine right now.

    :param read_stat: returns ``/proc/stat``'s text (the file by default).
    :returns: None when no tick passed.
    :raises OSError: when there is no ``/proc/stat`` (macOS).
    :raises ValueError: when it has no ``cpu`` line.
    """
    read = read_stat or _read_proc_stat
    before, own_before = CpuTimes.parse(read()), _own_cpu_s()
    time.sleep(seconds)
    after, own = CpuTimes.parse(read()), _own_cpu_s() - own_before
    return after.busy_cpus_since(before, own * _ticks_per_s())


def host_load(read_stat: Callable[[], str] | None = None,
              seconds: float = LOAD_SAMPLE_S) -> float:
    """How many CPUs other processes keep busy: :func:`sample_busy_cpus`, or where
    that gives nothing (no ``/proc/stat``) the 1-minute load average, which lags (a
    benchmark that just ended still counts for a minute)."""
    try:
        busy = sample_busy_cpus(read_stat, seconds)
    except OSError:
        busy = None
    except ValueError as exc:
        logger.warning("cpu platform: %s; using the 1-minute load average", exc)
        busy = None
    return busy if busy is not None else _load_average()


def wait_environment(option: str, env: Mapping[str, str]) -> dict[str, str]:
    """What a process Quire starts for a cpu engine must have in its environment for
    the ``wait_policy`` option ``option`` to take effect, with the decision logged;
    empty when the user set ``OMP_WAIT_POLICY`` in ``env`` (inherited).

    :raises ValueError: when ``option`` is not one :func:`choose_wait_policy` accepts.
    """
    decision = host_wait_policy(option, env)
    logger.info("cpu platform: OpenMP threads of the engine processes %s (%s)",
                "wait passively" if decision.policy == "passive" else "spin, then sleep",
                decision.reason)
    return decision.environment()


def passive_waiting(env: Mapping[str, str]) -> bool:
    """Whether OpenMP threads sleep as soon as they are idle (``OMP_WAIT_POLICY``)."""
    return env.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE"


class StepThreads:
    """One thread for single-token steps, ``threads`` for the rest (passive waiting).

    A step of one token (one sequence decoding) is a string of small kernels; with
    ``OMP_WAIT_POLICY=PASSIVE`` every one of them pays for waking the second thread,
    which costs more than the thread gives: 57 ms/token on one thread against 69 on two
    (2 cores). Steps with more tokens get every thread back. Switching is a flag write
    (~0.5 us). With spinning threads (libgomp's default) two threads are faster
    (41-45 ms), and this is not used.
    """

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._current = threads

    def begin_step(self, num_tokens: int) -> None:
        wanted = 1 if num_tokens == 1 else self.threads
        if wanted != self._current:
            torch.set_num_threads(wanted)
            self._current = wanted


def _read_proc_stat() -> str:
    with open("/proc/stat") as f:
        return f.read()


def _own_cpu_s() -> float:
    times = os.times()
    return times.user + times.system


def _ticks_per_s() -> int:
    try:
        return os.sysconf("SC_CLK_TCK")
    except (AttributeError, OSError, ValueError):  # not Unix: Linux's usual figure
        return 100


def _load_average() -> float:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # not Unix: no figure, so not busy
        return 0.0


def _affinity_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _cgroup_cpu_quota(cgroup: Path) -> int | None:
    """``cpu.max`` as whole CPUs (quota / period, rounded up); None when unlimited."""
    try:
        quota, period = (cgroup / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max" or not quota.isdigit() or not period.isdigit() or int(period) == 0:
        return None
    return max(1, -(-int(quota) // int(period)))
