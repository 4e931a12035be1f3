"""Orthonormal Hadamard rotations of groups along a tensor's last dim: the basis ``w8a8``
quantises its weights and activations in (:func:`rotate_groups`, one product by ``H``),
and int8 KV pages their groups of 16 (:func:`butterflies`, the adds the C kernels
repeat bit for bit; ``quire.ops.kv_quant``).

``H`` (``n x n``, ``n`` a power of two) is Sylvester's Hadamard matrix over ``sqrt(n)``:
symmetric and its own inverse, so a product keeps its value when both sides turn,
``(W H) (H x) = W x``. A weight row's quantised groups of 32 hold ``W H`` and the
product's activations are ``H x``, quantised per 32 values in turn. An activation
outlier channel is spread over its group instead of setting the int8 step of the other
31 values (the accuracy it buys and what it costs: docs/quantization.md).
"""

from __future__ import annotations

import math

import torch

_MATRICES: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}


def hadamard_matrix(n: int, dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu") -> torch.Tensor:
    """The orthonormal ``n x n`` Sylvester-Hadamard matrix (cached per dtype and device).

    :raises ValueError: for an ``n`` that is not a power of two.
    """
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard matrix of size {n}: the size must be a power of two")
    device = torch.device(device)
    key = (n, dtype, device)
    if key not in _MATRICES:
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < n:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
        _MATRICES[key] = (h / math.sqrt(n)).to(dtype=dtype, device=device)
    return _MATRICES[key]


def rotate_groups(x: torch.Tensor, n: int) -> torch.Tensor:
    """``x`` with every group of ``n`` along its last dim multiplied by ``H``, in float32
    (``H``'s entries, ``1 / sqrt(n)``, are not bfloat16 numbers), returned in ``x``'s
    shape and dtype (the last dim a multiple of ``n``)."""
    h = hadamard_matrix(n, torch.float32, x.device)
    groups = x.reshape(-1, n).float()  # one 2-D product: a third faster for a decode row
    return torch.mm(groups, h).view(x.shape).to(x.dtype)


def butterflies(groups: torch.Tensor) -> torch.Tensor:
    """``H g`` for every group ``g`` of the last dim (a power of two long, float32) as
    butterflies ``(a + b, a - b)`` at distances 1, 2, 4, ... in that order, then times
    ``1 / sqrt(n)``: an order of adds a C kernel can repeat for the same bits, which a
    matrix product does not promise."""
    shape, n = groups.shape, groups.shape[-1]
    h = 1
    while h < n:
        pairs = groups.reshape(*shape[:-1], n // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        groups = torch.stack((a + b, a - b), dim=-2).reshape(shape)
        h *= 2
    return groups * (1 / math.sqrt(n))
