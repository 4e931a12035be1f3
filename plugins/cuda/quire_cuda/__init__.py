"""Quire platform plugin for NVIDIA GPUs.

Modules: ``plugin`` (the entry-point hook; imports nothing heavy), ``platform``
(:class:`CudaPlatform`: detection, factories, tuning of the core's Triton kernels),
``memory`` (:class:`CudaMemoryProfiler` over ``torch.cuda``).

The attention kernels are the core's portable Triton kernels (``quire.kernels``); this
package holds only what is NVIDIA-specific.
"""
