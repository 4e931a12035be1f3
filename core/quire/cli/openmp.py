"""OpenMP's wait policy for the ``quire`` process, chosen before torch loads OpenMP.

torch's CPU kernels (and MKL and oneDNN under them) run on OpenMP threads that, after a
parallel region, spin for a while before they sleep (libgomp's default). When the host's
cores are shared with other busy processes, a spinning thread holds a core that another
thread of the next region is waiting for, and every region waits for a time slice.
Measured on a 2-core host under a load average of ~3 (other processes' work), with 2
threads: a single-stream decode step took 116-262 ms with the default and 51-67 ms with
``OMP_WAIT_POLICY=PASSIVE`` (idle threads sleep at once; 1 thread: 56-65 ms), and a
cold ``quire generate`` 27-35 s against 14 s. On an idle host the price is a wake-up per
parallel region; not measured here (no idle host was available), expected to be small
beside a step's matmuls.

libgomp reads the variable once, when it is loaded (with torch), so this runs before the
CLI imports anything that imports torch. The variable is removed again right after, so
processes the CLI starts (the peer engines of ``quire bench``) keep their own default.
A value the user set, or a torch already imported, is left alone.
"""

from __future__ import annotations

import os
import sys

_POLICY_ENV = "OMP_WAIT_POLICY"


def prefer_passive_waiting() -> None:
    """Load torch with ``OMP_WAIT_POLICY=PASSIVE`` unless the user chose a policy."""
    if _POLICY_ENV in os.environ or "torch" in sys.modules:
        return
    os.environ[_POLICY_ENV] = "PASSIVE"
    try:
        import torch  # noqa: F401  (loads libgomp, which reads the policy now)
    finally:
        del os.environ[_POLICY_ENV]
