"""Quire platform plugin for Intel Gaudi accelerators (``--device gaudi``, torch device
``hpu``).

Written against the vendor API documentation (habana_frameworks.torch, its FusedSDPA
kernel, HCCL), NOT run on Gaudi hardware: no HPU or Gaudi software stack was available
where it was written. Until someone runs ``quire conformance --device gaudi`` on a real
device, treat it as unverified.

Modules: ``plugin`` (the entry point; imports nothing heavy), ``platform`` (availability
and factories), ``attention`` (FusedSDPA prefill, flat block-table decode), ``memory``
(HPU memory readings). ``habana_frameworks`` is imported by ``availability()`` and the
factories only.
"""
