"""Random weights in any format, for kernel tests and the conformance suite.

GGUF blocks are random bytes, so every field takes every value (sub-block scales and
minima, high bits, signs), with the f16 scale fields drawn as small finite numbers
instead (a random NaN or infinity says nothing about a kernel's arithmetic). Row formats
are random float weights quantised by :func:`~quire.quantization.quantize.quantize_rows`.
"""

from __future__ import annotations

import torch

from quire.quantization.formats import FORMATS
from quire.quantization.quantize import quantize_rows
from quire.quantization.tensor import QuantizedTensor

#: Byte offsets of each GGUF block type's f16 fields.
F16_FIELDS: dict[str, tuple[int, ...]] = {
    "q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "q8_0": (0,),
    "q2_k": (80, 82), "q3_k": (108,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,),
}
#: What the f16 scales are drawn as: N(0, 1) times this (products of order 1 for
#: a few hundred inputs of order 1).
SCALE = 0.01


def random_quantized(format_name: str, rows: int, cols: int,
                     generator: torch.Generator) -> QuantizedTensor:
    """A ``[rows, cols]`` weight in ``format_name`` (``cols`` whole blocks)."""
    fmt = FORMATS[format_name]
    if fmt.row_scaled:
        return quantize_rows(torch.randn(rows, cols, generator=generator), format_name)
    if format_name in ("f32", "f16", "bf16"):
        dtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
        values = torch.randn(rows, cols, generator=generator).to(dtype[format_name])
        return QuantizedTensor(fmt, values.view(torch.uint8), cols)
    n_blocks = rows * cols // fmt.block
    data = torch.randint(0, 256, (n_blocks, fmt.block_bytes), dtype=torch.uint8,
                         generator=generator)
    for offset in F16_FIELDS[format_name]:
        scale = (torch.randn(n_blocks, generator=generator) * SCALE).half()
        data[:, offset:offset + 2] = scale.view(torch.uint8).view(n_blocks, 2)
    return QuantizedTensor(fmt, data.view(rows, fmt.row_bytes(cols)), cols)
