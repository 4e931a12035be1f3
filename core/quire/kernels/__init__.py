"""Portable device kernels (Triton), shared by every GPU platform plugin.

Modules:

- ``triton_backend``: :class:`TritonAttentionBackend` (the ``AttentionBackend`` contract
  over the kernels), its per-step metadata and :class:`TritonAttentionConfig` (launch
  parameters a platform tunes). Does not import triton.
- ``triton_attention``: the ``@triton.jit`` kernels (KV write, prefill, split-K decode and
  its merge) and their launchers. Imports triton, so it is imported on first launch only.

Triton is not a vendor library: the same kernels compile for every GPU that Triton targets and
run in Triton's interpreter on CPU tensors. Importing ``quire`` never imports triton.
"""

from quire.kernels.triton_backend import TritonAttentionBackend, TritonAttentionConfig

__all__ = ["TritonAttentionBackend", "TritonAttentionConfig"]
