"""The quantised-weight ops in plain torch: every platform's oracle and default.

A weight here is a :class:`~quire.quantization.tensor.QuantizedTensor`. The products
dequantise it to float32 a slab of rows at a time, so the float copy never exceeds
:data:`SLAB_BYTES` whatever the weight's size; a platform replaces these with kernels
that read the blocks in place (the cpu platform's C library, the Triton kernels).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from quire.quantization.hadamard import rotate_groups
from quire.quantization.tensor import QuantizedTensor

#: Most bytes of float32 weights the reference dequantises at once.
SLAB_BYTES = 64 << 20
#: Values of a row that share one activation scale in ``w8a8`` products on ``q8_0``.
ACTIVATION_BLOCK = 32
#: The groups ``w8a8``'s rotated weights and rows turn by: the blocks that share a scale,
#: so that an outlier is spread over exactly the values whose step it sets.
HADAMARD_GROUP = ACTIVATION_BLOCK


def quantized_linear(x: torch.Tensor, weight: QuantizedTensor,
                     bias: torch.Tensor | None = None, *,
                     int8_activations: bool = False,
                     bf16_activations: bool = False) -> torch.Tensor:
    """``x W^T (+ bias)`` for a quantised ``W`` ``[rows, cols]``: ``[..., cols] ->
    [..., rows]`` in ``x``'s dtype.

    Weight-only (the default): ``x`` is taken as float32 and multiplied by the float32
    weights, float32 sums. A platform may multiply bfloat16 ``x`` by the weights rounded
    to bfloat16 instead (float32 sums, as a bfloat16 model of the dequantised weights
    computes); the conformance suite's bfloat16 tolerance allows it.
    ``bf16_activations`` asks for that for float32 ``x`` too, with a float32 result: ``x``
    and the weights rounded to bfloat16, float32 sums (what PyTorch's
    ``float32_matmul_precision="medium"`` allows a float32 product), here exactly that;
    a platform may round fewer rows (a decode's), round the rows but not the weights, or
    round nothing, so it is held to the bfloat16 tolerance. The engine sets it on a
    model's layers (:class:`QuantizedLinearKernel`) only where
    ``Platform.bf16_activations`` says so, so an op that does not take it is never
    given it.
    ``int8_activations`` (``w8a8``; ``weight`` ``int8`` or ``q8_0``): with ``int8``
    weights, each row of ``x`` is quantised to int8 with ``scale = max |x| / 127``
    (round to nearest), the integer products are summed exactly, and the sum is scaled
    by both scales, as an integer kernel computes it. With ``q8_0`` weights, each 32
    values of a row take their own scale (:func:`quantize_activation_blocks`, llama.cpp's
    Q8 activations) and each 32-value integer sum is scaled by both blocks' scales; here
    in float64, so the result is that sum to float64 rounding.
    """
    rows = x.reshape(-1, weight.cols)
    if int8_activations and weight.format.name == "q8_0":
        y = _q8_blocks_linear(rows, weight, bias)
    elif int8_activations:
        if weight.format.name != "int8":
            raise ValueError(f"int8 activations need int8 weights (per row, or q8_0 "
                             f"blocks), got {weight.format.name}")
        qx, sx = quantize_activations(rows)
        qw = weight.data.view(torch.int8)
        # float64 holds every int8 x int8 sum of up to 2^38 terms exactly
        acc = qx.double() @ qw.double().t()
        y = (acc * sx.double().unsqueeze(1) * weight.scale.double()).float()
        if bias is not None:
            y = y + bias.float()
    else:
        xf = rows.float()
        if bf16_activations:
            xf = xf.to(torch.bfloat16).float()

        def dequantized(w: QuantizedTensor) -> torch.Tensor:
            f = w.dequantize()
            return f.to(torch.bfloat16).float() if bf16_activations else f

        slab = max(1, SLAB_BYTES // (4 * weight.cols))
        if weight.rows <= slab:
            y = F.linear(xf, dequantized(weight), None if bias is None else bias.float())
        else:
            y = torch.cat([F.linear(xf, dequantized(
                weight.narrow_rows(r, min(slab, weight.rows - r))))
                for r in range(0, weight.rows, slab)], dim=1)
            if bias is not None:
                y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.rows)


def _q8_blocks_linear(rows: torch.Tensor, weight: QuantizedTensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
    """Q8 activations times ``q8_0`` weights, float32 ``[n, rows]``: both sides' values
    (int8 times a scale) are exact in float64, and so is each product but for one
    rounding, so this is the blockwise integer sum scaled, to float64 rounding."""
    qx, dx = quantize_activation_blocks(rows)
    xd = (qx.double().view(rows.shape[0], -1, ACTIVATION_BLOCK)
          * dx.double().unsqueeze(2)).reshape(rows.shape)
    slab = max(1, SLAB_BYTES // (8 * weight.cols))
    y = torch.cat([F.linear(xd, weight.narrow_rows(r, min(slab, weight.rows - r))
                            .dequantize(torch.float64))
                   for r in range(0, weight.rows, slab)], dim=1).float()
    return y if bias is None else y + bias.float()


def quantize_activation_blocks(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each 32 values of each row of ``rows`` ``[n, k]`` (``k`` a multiple of 32) as int8
    ``[n, k]`` and their float32 scales ``[n, k / 32]``: ``max |x| / 127`` (0 for an
    all-zero block), round half to even, as ``csrc/quant_q8.c`` quantises them."""
    xf = rows.float().reshape(rows.shape[0], -1, ACTIVATION_BLOCK)
    d = xf.abs().amax(dim=2) / 127
    q = torch.round(xf / torch.where(d > 0, d, 1.0).unsqueeze(2)).clamp_(-127, 127)
    return q.to(torch.int8).reshape(rows.shape), d


def quantize_activations(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``rows`` ``[n, k]`` as int8 and its float32 scale ``[n]``
    (``max |x| / 127``, 1 for a zero row; round half to even, as ``torch.round``)."""
    xf = rows.float()
    amax = xf.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127, 1.0)
    q = torch.round(xf / scale.unsqueeze(1)).clamp_(-127, 127).to(torch.int8)
    return q, scale


def quantized_embedding(ids: torch.Tensor, weight: QuantizedTensor,
                        dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows ``ids`` (int64 ``[T]``) of a quantised ``[vocab, dim]`` table, ``[T, dim]``
    in ``dtype``: only the rows asked for are dequantised."""
    return weight.select_rows(ids.reshape(-1)).dequantize(dtype).reshape(*ids.shape,
                                                                         weight.cols)


class QuantizedLinearKernel:
    """A :class:`~quire.models.layers.linear.LinearKernel` over a layer's quantised parts:
    one ``quantized_linear`` call per part, the outputs side by side, zero columns for
    rows this rank holds none of (a tensor-parallel vocabulary's padding).

    ``bf16_activations`` (False until the engine sets it, where
    ``Platform.bf16_activations`` says so) passes the op's keyword of that name with
    weight-only products."""

    def __init__(self, parts: list[QuantizedTensor], op: Callable[..., torch.Tensor],
                 out_features: int, int8_activations: bool = False,
                 rotated: bool = False) -> None:
        self.parts = parts
        self.op = op
        self.out_features = out_features
        self.int8_activations = int8_activations
        #: the parts hold ``W H`` (groups of 32 in the Hadamard basis: ``w8a8``), so each
        #: product's rows are turned the same way first, ``(W H)(H x) = W x``
        self.rotated = rotated
        self.bf16_activations = False
        self.padding = out_features - sum(p.rows for p in parts)
        if self.padding < 0:
            raise ValueError(f"quantised parts hold {out_features - self.padding} rows, "
                             f"the layer {out_features}")

    @property
    def formats(self) -> tuple[str, ...]:
        return tuple(p.format.name for p in self.parts)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        kwargs = {"int8_activations": True} if self.int8_activations else \
            {"bf16_activations": True} if self.bf16_activations else {}
        if self.rotated:
            x = rotate_groups(x, HADAMARD_GROUP)
        if len(self.parts) == 1 and not self.padding:
            return self.op(x, self.parts[0], bias, **kwargs)
        ys = [self.op(x, part, None, **kwargs) for part in self.parts]
        if self.padding:
            ys.append(x.new_zeros(*x.shape[:-1], self.padding))
        y = torch.cat(ys, dim=-1)
        return y if bias is None else y + bias
