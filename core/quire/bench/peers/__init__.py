"""Peer engines run on the same workload as Quire, each from its own virtual environment.

- ``spec.py``: the peers: venv location, install steps (PEERS.md), worker, environment
- ``install.py``: ``quire bench install-peer NAME``
- ``models.py``: the files each peer loads, converted once from Quire's model and cached
- ``runner.py``: runs a worker as a subprocess (JSON job in, JSON result out)
- ``hf_worker.py``, ``vllm_worker.py``, ``llamacpp_worker.py``: the workers, standard
  library plus their peer only (quire is not installed in a peer's venv)
- ``worker_io.py``, ``clock.py``, ``procmem.py``: what the workers share, standard library
  only; Quire's own measurements use ``clock`` and ``procmem`` too, so every engine is
  timed and measured by the same code
"""
