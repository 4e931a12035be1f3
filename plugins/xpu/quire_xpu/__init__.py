"""Quire platform plugin for Intel GPUs (``--device xpu``).

Written against the vendor API documentation (torch.xpu, intel_extension_for_pytorch,
torch.distributed "xccl"), NOT run on Intel hardware: no Intel GPU or IPEX was available
where it was written. Until someone runs ``quire conformance --device xpu`` on a real
device, treat it as unverified.

Modules: ``plugin`` (the entry point; imports nothing heavy), ``platform`` (availability
and factories), ``attention`` (IPEX paged attention, or the portable Triton backend),
``memory`` (torch.xpu memory readings). Nothing here imports a vendor library at import
time; ``intel_extension_for_pytorch`` is imported when an attention backend is made.
"""
