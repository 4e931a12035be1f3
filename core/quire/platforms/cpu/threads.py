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

How idle threads wait between parallel regions is OpenMP's ``OMP_WAIT_POLICY``, read
once when torch loads libgomp, so it is the user's to set; Quire leaves libgomp's
default (spin a little, then sleep). Measured on a 2-core host (SmolLM2-135M float32,
2 threads, medians of one run each):

=========================================  =============  ==========  ===============
                                           default (spin) ``PASSIVE``  ``PASSIVE``, 1
                                                                       thread at 1 token
=========================================  =============  ==========  ===============
idle host: 64-row decode step              251-265 ms     295-335 ms
idle host: one stream, ms per token        41-45 ms       69 ms       57 ms
one other busy process: 64-row step        737-1186 ms    473 ms
one other busy process: ms per token       148-312 ms     66 ms
=========================================  =============  ==========  ===============

So on a host of its own (the case to be fast in) spinning wins by 15-40%, and on a host
whose cores other busy processes share, ``OMP_WAIT_POLICY=PASSIVE`` is worth 1.6-4x.
With a passive policy, a second thread woken for each small kernel of a single-token
step costs more than it gives, so :class:`StepThreads` then runs those steps on one
thread (when the count is this module's choice, not the user's).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

#: Environment variable that fixes the thread count of the cpu platform.
THREADS_ENV = "QUIRE_CPU_THREADS"
_USER_THREAD_ENVS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


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
