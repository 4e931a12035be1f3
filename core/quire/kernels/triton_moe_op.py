"""The ``fused_moe`` op a GPU platform puts in its :class:`~quire.ops.OpSet`, over the
Triton kernels of :mod:`quire.kernels.triton_moe`.

Importing this module does not import triton: a platform names this function in
``make_ops()`` at engine build, and the kernels (and triton) are imported on its first
call, as the attention backend does.
"""

from __future__ import annotations

import torch


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """:func:`quire.ops.moe.fused_moe`'s contract, run by the Triton kernels. Expert ids
    are not range-checked here (that would read them back from the device)."""
    from quire.kernels import triton_moe

    return triton_moe.fused_moe(hidden, w13, w2, weights, ids)
