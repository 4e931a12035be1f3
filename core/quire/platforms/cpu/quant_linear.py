"""The cpu platform's quantised linear: products straight on a weight's blocks.

:func:`quire.ops.quantized.quantized_linear` dequantises a slab of the weight to float32
and calls ``F.linear``: every product writes and reads a float copy of the weight, which
for a one-row decode product is several times the traffic of the quantised bytes. The C
kernels (``csrc/quant_gemm.c``) dequantise blocks into registers or a cache-resident
panel as they multiply, with the reference's float operations (so results differ from it
only by summation order), and run ``w8a8`` on int8 dot-product instructions.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from quire.ops.quantized import quantized_linear
from quire.platforms.cpu.native import NativeKernels
from quire.quantization.tensor import QuantizedTensor

QuantizedLinear = Callable[..., torch.Tensor]


#: Rows a product takes int8 activations for, with ``decode_activations=int8``; and
#: the most rows the int8 tiles of up to four rows take with ``activations=int8`` (more
#: take the batch kernel, which unpacks the weight once a call).
Q8_MAX_ROWS = 4

#: Rows above which bfloat16 activations take the bfloat16 panel kernel, which unpacks
#: the whole weight once a call; up to them the direct path (float32 products, the
#: blocks read once for every four rows) is faster. Weights of at least
#: :data:`LONG_ROW_COLS` columns keep the direct path up to :data:`BF16_MIN_ROWS_LONG`
#: rows (measured per shape; the figures are in docs/quantization.md). The float32
#: kernel takes the direct path up to csrc/quant_gemm.c's DIRECT_BATCH_ROWS, which must
#: not be fewer.
BF16_MIN_ROWS = 4
BF16_MIN_ROWS_LONG = 8
LONG_ROW_COLS = 1024


def bf16_min_rows(cols: int) -> int:
    """The rows up to which products on a weight ``cols`` wide keep the direct path
    (:data:`BF16_MIN_ROWS`, or :data:`BF16_MIN_ROWS_LONG` for long rows)."""
    return BF16_MIN_ROWS_LONG if cols >= LONG_ROW_COLS else BF16_MIN_ROWS


def takes_bf16_kernel(native: NativeKernels, x: torch.Tensor, cols: int,
                      bf16_activations: bool) -> bool:
    """Whether weight-only products of host rows ``x`` (float32 or bfloat16, ``cols``
    wide) run on the bfloat16 kernel: bfloat16 rows, or float32 ones with
    ``bf16_activations``, more than :func:`bf16_min_rows` of them, on a build that has
    it. The op's rule, and the fused layer's for a layer's parts in one call."""
    return ((x.dtype == torch.bfloat16 or bf16_activations) and native.has_quant_bf16
            and x.numel() > bf16_min_rows(cols) * cols)


#: The most rows that take the bfloat16 decode rows (:func:`takes_bf16_rows`): the rows
#: csrc/quant_gemm.c's direct path takes (DIRECT_BATCH_ROWS), as the fused layers' one
#: call does for a product whose bfloat16-kernel bit is clear.
BF16_ROWS_MAX = 8


def takes_bf16_rows(native: NativeKernels, weight: QuantizedTensor, bf16_rows: bool,
                    bf16_decode: bool | None, bf16_activations: bool) -> bool:
    """Whether a product's decode rows (up to :data:`BF16_ROWS_MAX`, not on the bfloat16
    kernel) take the direct path with the rows rounded to bfloat16
    (:meth:`NativeKernels.quant_rows_bf16`): bfloat16 rows (no rounding then), or
    float32 ones as ``bf16_decode`` says (None: as ``bf16_activations`` does), where the
    build takes the weight's format (Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K at the
    levels with AVX512_BF16). The op's rule, and the fused layers' for each part."""
    wanted = bf16_rows or (bf16_activations if bf16_decode is None else bf16_decode)
    return wanted and native.quant_rows_bf16_fits(weight)


def make_quantized_linear(native: NativeKernels | None, int8_decode: bool = False,
                          int8_all: bool = False, bf16_decode: bool | None = None
                          ) -> QuantizedLinear:
    """``quantized_linear(x, weight, bias=None, *, int8_activations=False,
    bf16_activations=False)`` with the reference op's signature and contract, on the C
    kernels of ``native``.

    The kernels take host tensors: ``x`` of any leading shape in float32 or bfloat16, a
    weight in any format of :mod:`quire.quantization.formats` whose rows may be strided,
    an optional bias. With ``int8_decode``, products of up to :data:`Q8_MAX_ROWS` rows
    on a format ``csrc/quant_q8.c`` takes quantise the rows to int8 per 32 values
    (the platform's ``decode_activations`` option); with ``int8_all``, products of any
    number of rows do (the ``activations`` option: more than :data:`Q8_MAX_ROWS` on the
    batch kernel where the build has it, bfloat16 rows widened to float32 first).
    ``w8a8`` on ``q8_0`` weights (``int8``'s groups) takes the same Q8 products, so its
    activations are int8 per 32 values of a token. Else,
    bfloat16 ``x`` of more than
    :func:`bf16_min_rows` rows multiplies bfloat16-rounded weights in float32 sums where
    the build has AVX512_BF16 (what a bfloat16 model with the dequantised weights
    computes); fewer rows, or no such build, are widened to float32, and every result is
    rounded back to ``x``'s dtype. With ``bf16_activations`` (set on a model's layers
    where the platform's ``activations`` option resolves to ``bfloat16``), float32
    ``x`` of more than :func:`bf16_min_rows` rows takes the same bfloat16 kernel,
    rounded to bfloat16 on the way in, and keeps its float32 sums as the result. Fewer
    rows (decode rows) take the direct path, each weight row read once for every four
    rows, with float32 activations; or rounded to bfloat16 times the exact weights
    (:func:`takes_bf16_rows`: bfloat16 ``x``, and float32 ``x`` as ``bf16_decode``
    says, None following ``bf16_activations``: the platform's ``decode_activations``
    option). Everything else falls back to the torch reference
    (:func:`quire.ops.quantized.quantized_linear`): no kernels (``native`` None or a
    library without them), another device or dtype, ``w8a8`` rows longer than
    :data:`NativeKernels.QUANT_I8_MAX_K`, and a kernel that could not allocate scratch.
    """
    if native is None or not native.has_quant_gemm:
        return quantized_linear

    def linear(x: torch.Tensor, weight: QuantizedTensor, bias: torch.Tensor | None = None,
               *, int8_activations: bool = False,
               bf16_activations: bool = False) -> torch.Tensor:
        if not (x.device.type == "cpu" and weight.device.type == "cpu"
                and x.dtype in (torch.float32, torch.bfloat16) and x.shape[-1] == weight.cols
                and (bias is None or bias.device.type == "cpu")):
            return quantized_linear(x, weight, bias, int8_activations=int8_activations,
                                    bf16_activations=bf16_activations)
        if int8_activations and weight.format.name == "q8_0":
            return w8a8_blocks(x, weight, bias)
        if int8_activations and weight.format.name != "int8":
            raise ValueError(f"int8 activations need int8 weights, got {weight.format.name}")
        b = None if bias is None else bias.to(torch.float32).contiguous()
        if int8_all and not int8_activations and native.quant_q8_fits(weight):
            y = _int8_rows(x.reshape(-1, weight.cols), weight, b)
            if y is not None:
                return y.to(x.dtype).reshape(*x.shape[:-1], weight.rows)
        if not int8_activations and takes_bf16_kernel(native, x, weight.cols,
                                                      bf16_activations):
            # float32 rows are rounded in the kernel's call, not by a torch pass first
            y = native.quant_linear_bf16(x.reshape(-1, weight.cols).contiguous(), weight, b)
            if y is not None:
                return y.to(x.dtype).reshape(*x.shape[:-1], weight.rows)
        rows = x.reshape(-1, weight.cols).to(torch.float32).contiguous()
        entry = native.quant_linear_i8 if int8_activations else native.quant_linear
        y = None
        if (int8_decode and not int8_activations and rows.shape[0] <= Q8_MAX_ROWS
                and native.quant_q8_fits(weight)):
            y = native.quant_linear_q8(rows, weight, b)
        elif (not int8_activations and rows.shape[0] <= BF16_ROWS_MAX
              and takes_bf16_rows(native, weight, x.dtype == torch.bfloat16, bf16_decode,
                                  bf16_activations)):
            y = native.quant_rows_bf16(rows, weight, b)
        if y is None:
            y = entry(rows, weight, b)
        if y is None:
            return quantized_linear(x, weight, bias, int8_activations=int8_activations,
                                    bf16_activations=bf16_activations)
        return y.to(x.dtype).reshape(*x.shape[:-1], weight.rows)

    def _int8_rows(flat: torch.Tensor, weight: QuantizedTensor,
                   bias: torch.Tensor | None) -> torch.Tensor | None:
        rows = flat.to(torch.float32).contiguous()
        batch = rows.shape[0] > Q8_MAX_ROWS and native.has_quant_q8_batch
        return native.quant_linear_q8(rows, weight, bias, batch=batch)

    def w8a8_blocks(x: torch.Tensor, weight: QuantizedTensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
        """``w8a8`` on Q8_0 blocks: Q8 activations, ``csrc/quant_q8.c``'s integer
        products (the batch kernel for more than :data:`Q8_MAX_ROWS` rows where the
        build has it; the reference where the build has no Q8 products)."""
        b = None if bias is None else bias.to(torch.float32).contiguous()
        fits = native.quant_q8_fits(weight)
        y = _int8_rows(x.reshape(-1, weight.cols), weight, b) if fits else None
        if y is None:
            return quantized_linear(x, weight, bias, int8_activations=True)
        return y.to(x.dtype).reshape(*x.shape[:-1], weight.rows)

    linear.__doc__ = quantized_linear.__doc__
    return linear
