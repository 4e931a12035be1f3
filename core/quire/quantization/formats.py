"""The weight formats Quire keeps in memory as they are stored, one id each.

A format is a block layout: ``block`` consecutive weights of one row take
``block_bytes`` bytes, and a row of ``cols`` weights is ``cols / block`` blocks, back to
back. GGUF's types keep llama.cpp's ids and byte layouts (``ggml-common.h``); Quire's own
row-scaled formats (weights quantised on load, :mod:`quire.quantization.quantize`) take
ids from 256 up and carry one float32 scale per row beside the rows.

These ids cross into kernels (the cpu platform's C library, the Triton kernels), so they
never change once shipped.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class QuantFormat:
    """One block layout."""

    #: lower-case name, as users and logs see it (``q4_k``, ``int8``)
    name: str
    #: the id kernels switch on: a ``GGMLQuantizationType`` value, or 256 and up
    id: int
    #: weights per block
    block: int
    #: bytes per block
    block_bytes: int
    #: whether the tensor carries a float32 scale per row (Quire's row formats)
    row_scaled: bool = False

    def row_bytes(self, cols: int) -> int:
        """Bytes one row of ``cols`` weights takes.

        :raises ValueError: when ``cols`` is not a whole number of blocks.
        """
        if cols % self.block:
            raise ValueError(f"{self.name}: a row of {cols} weights is not a whole number "
                             f"of {self.block}-weight blocks")
        return cols // self.block * self.block_bytes


_GGML = (  # name, ggml id, block, bytes
    ("f32", 0, 1, 4), ("f16", 1, 1, 2), ("bf16", 30, 1, 2),
    ("q4_0", 2, 32, 18), ("q4_1", 3, 32, 20), ("q5_0", 6, 32, 22), ("q5_1", 7, 32, 24),
    ("q8_0", 8, 32, 34), ("q2_k", 10, 256, 84), ("q3_k", 11, 256, 110),
    ("q4_k", 12, 256, 144), ("q5_k", 13, 256, 176), ("q6_k", 14, 256, 210),
)
#: Every format, by name.
FORMATS: dict[str, QuantFormat] = {
    **{name: QuantFormat(name, fid, block, size) for name, fid, block, size in _GGML},
    #: int8 weights, one float32 scale per output row (w = scale * q)
    "int8": QuantFormat("int8", 256, 1, 1, row_scaled=True),
    #: float8 e4m3 (OCP ``e4m3fn``) weights, one float32 scale per output row
    "fp8_e4m3": QuantFormat("fp8_e4m3", 257, 1, 1, row_scaled=True),
}
_BY_ID = {fmt.id: fmt for fmt in FORMATS.values()}
#: GGUF tensor types kept as they are (the rest are refused by name at load).
GGUF_TYPES: tuple[str, ...] = tuple(name for name, *_ in _GGML)


def format_named(name: str) -> QuantFormat:
    """:raises ValueError: naming the known formats."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown weight format {name!r}; known: "
                         f"{', '.join(FORMATS)}") from None


def gguf_format(ggml_type: int) -> QuantFormat | None:
    """The format of GGUF tensor type ``ggml_type`` (a ``GGMLQuantizationType`` value),
    or None for a type Quire does not keep."""
    fmt = _BY_ID.get(ggml_type)
    return None if fmt is None or fmt.row_scaled else fmt


def format_of_ggml(ggml_type: int, type_name: str, tensor: str) -> QuantFormat:
    """The format of a GGUF tensor type.

    :param type_name: the type's GGUF name (``IQ2_XS``), for the message.
    :raises ValueError: naming the tensor and its type when Quire does not keep it.
    """
    fmt = gguf_format(ggml_type)
    if fmt is None:
        raise ValueError(f"GGUF tensor {tensor!r} is of type {type_name}, which quire does "
                         f"not run; supported: {', '.join(t.upper() for t in GGUF_TYPES)}")
    return fmt
