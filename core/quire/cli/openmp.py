"""OpenMP's wait policy for the ``quire`` process, chosen before torch loads OpenMP.

torch's CPU kernels (and MKL and oneDNN under them) run on OpenMP threads that, after a
parallel region, spin for a while before they sleep (libgomp's default). When the host's
cores are shared with other busy processes, a spinning thread holds a core that another
thread of the next region is waiting for, and every region waits for a time slice.
``OMP_WAIT_POLICY=PASSIVE`` makes idle threads sleep at once instead: each parallel
region then pays a wake-up, which costs when the host is idle. Measured on a 2-core host
(SmolLM2-135M float32, 2 threads, the offline batch W1 of 64 x 128 -> 128 tokens):

==========================================  ==============  ==============
                                            spin (default)  passive
==========================================  ==============  ==============
nothing else busy                           270 tokens/s    205 tokens/s
one other process busy on one core          95 tokens/s     166 tokens/s
a cold ``quire generate`` of 64 tokens,     49-51 s         14.5-18 s
other agents' load average ~3
==========================================  ==============  ==============

A shared host is the common case for this engine's CPU users (and for its own
benchmark host), and the loss there is the larger one, so the ``quire`` command loads
OpenMP passive unless told otherwise: on a dedicated host, ``OMP_WAIT_POLICY=ACTIVE``
(or any value) is left as given. Single-stream decode is unaffected either way: its
single-token steps run on one thread (``quire.platforms.cpu.threads.StepThreads``).

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
