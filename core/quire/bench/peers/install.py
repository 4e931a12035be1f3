"""``quire bench install-peer NAME``: create the peer's venv and pip-install it there.

Exactly the steps of ``PEERS.md`` (see :data:`quire.bench.peers.spec.PEERS`), run with
the venv's own pip; pip's output goes to ``<cache>/peers/NAME.log``, which ends with
``NAME rc=<exit status>``. Nothing is installed into quire's own environment.
"""

from __future__ import annotations

import subprocess
import venv
from collections.abc import Callable
from pathlib import Path

from quire.bench.peers.spec import PeerSpec

#: A module whose import shows the peer works.
_PROBES = {"hf": "transformers", "vllm": "vllm", "llamacpp": "llama_cpp"}


def is_installed(spec: PeerSpec) -> bool:
    """Whether the venv exists and imports the peer."""
    python = spec.python()
    if not python.exists():
        return False
    probe = _PROBES.get(spec.name, spec.name)
    proc = subprocess.run([str(python), "-c", f"import {probe}"], capture_output=True, check=False)
    return proc.returncode == 0


def install(spec: PeerSpec, say: Callable[[str], None] = print) -> int:
    """Create ``spec``'s venv if needed and run its install steps; the last exit status.

    Long (vLLM: minutes; llama.cpp builds from source: about 20 minutes on 2 cores).
    """
    venv_dir: Path = spec.venv()
    if not spec.python().exists():
        say(f"creating {venv_dir}")
        venv.EnvBuilder(with_pip=True).create(venv_dir)
    spec.log().parent.mkdir(parents=True, exist_ok=True)
    rc = 0
    with open(spec.log(), "a", encoding="utf-8") as log:
        for step in spec.install_steps:
            cmd = [str(spec.python()), "-m", "pip", *step]
            say(f"running: {' '.join(cmd)}  (output: {spec.log()})")
            log.write(f"$ {' '.join(cmd)}\n")
            log.flush()
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT,
                                 check=False).returncode
            if rc != 0:
                break
        log.write(f"{spec.name} rc={rc}\n")
    return rc
