"""Portable device kernels (Triton), shared by every GPU platform plugin.

Modules:

- ``triton_backend``: :class:`TritonAttentionBackend` (the ``AttentionBackend`` contract
  over the kernels), its per-step metadata and :class:`TritonAttentionConfig` (launch
  parameters a platform tunes). Does not import triton.
- ``triton_attention``: the ``@triton.jit`` kernels (KV write, prefill, split-K decode and
  its merge) and their launchers. Imports triton, so it is imported on first launch only.
- ``triton_fused``: RMSNorm with the residual add, the gated activations, and the rotary
  embedding with the KV-page write, one launch each. Imports triton.
- ``triton_ops``: those ops and ``fused_moe`` (``triton_moe``) as a platform puts them in
  its op set (``triton_ops()``); imports triton on an op's first call.

Triton is not a vendor library: the same kernels compile for every GPU that Triton targets and
run in Triton's interpreter on CPU tensors. Importing ``quire`` never imports triton.
"""

from quire.kernels.triton_backend import TritonAttentionBackend, TritonAttentionConfig

__all__ = ["TritonAttentionBackend", "TritonAttentionConfig"]
