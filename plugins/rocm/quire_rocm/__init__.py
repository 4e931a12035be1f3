"""Quire platform plugin for AMD GPUs (ROCm).

Modules: ``plugin`` (the entry-point hook; imports nothing heavy), ``platform``
(:class:`RocmPlatform`: detection, factories, AMD tuning of the core's Triton kernels),
``memory`` (:class:`RocmMemoryProfiler` over ``torch.cuda``, which ROCm torch provides).

The attention kernels are the core's portable Triton kernels (``quire.kernels``); this
package holds only what differs on AMD: detection through ``torch.version.hip``, launch
parameters for 64-wide wavefronts, and the note that torch's ``"nccl"`` is RCCL here.
"""
