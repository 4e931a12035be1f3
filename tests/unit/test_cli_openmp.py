"""The quire command loads OpenMP with passive waiting unless the user chose a policy.

Each case runs in a fresh interpreter (libgomp reads its settings once, when torch loads
it) and reads what libgomp settled on from ``OMP_DISPLAY_ENV=VERBOSE``: a passive policy
shows as ``GOMP_SPINCOUNT = '0'``, libgomp's default as a large spin count.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import quire

_CORE = str(Path(quire.__file__).resolve().parents[1])
_SCRIPT = """
import os
from quire.cli.openmp import prefer_passive_waiting
prefer_passive_waiting()
import torch
print("left in env:", os.environ.get("OMP_WAIT_POLICY"))
"""


def _run(env_extra: dict[str, str]) -> tuple[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env.update(env_extra, OMP_DISPLAY_ENV="VERBOSE",
               PYTHONPATH=os.pathsep.join([_CORE, env.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True,
                          text=True, timeout=300, check=True)
    return done.stdout, done.stderr


@pytest.mark.slow
def test_passive_by_default_and_not_inherited() -> None:
    stdout, stderr = _run({})
    assert "GOMP_SPINCOUNT = '0'" in stderr
    assert "left in env: None" in stdout  # processes started later keep their default


@pytest.mark.slow
def test_a_policy_the_user_set_is_kept() -> None:
    stdout, stderr = _run({"OMP_WAIT_POLICY": "ACTIVE"})
    assert "GOMP_SPINCOUNT = '0'" not in stderr
    assert "left in env: ACTIVE" in stdout
