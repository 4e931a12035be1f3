"""A GGUF file's tensor index and scalar metadata, read fast; tensors dequantised in torch.

Why not ``gguf.GGUFReader``: it builds a numpy view for every part of every metadata
field, and a GGUF file carries its whole tokenizer as metadata (SmolLM2's 49k tokens
and 48k merges: about 150k fields parts), which takes several seconds before the first
tensor is reached. This reader walks the header once with ``struct``, keeps scalar
values, skips arrays, and records where each tensor's bytes lie in a copy-on-write
memory map (writable views, so torch takes them without a copy or a warning).

Layout (GGUF v2/v3, little-endian): magic ``GGUF``, version u32, tensor count u64,
metadata count u64; metadata ``(key, type u32, value)``; tensor infos ``(name,
n_dims u32, dims u64 * n, type u32, offset u64)``; padding to ``general.alignment``
(default 32); tensor data, each at its offset from there.

A tensor comes back as its blocks (:func:`quantized`, a view of the map) or dequantised
(:func:`dequantize`, by :mod:`quire.quantization.dequant`: bit for bit ``gguf.quants``);
types without a torch path there go through ``gguf.quants.dequantize``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from quire.quantization.dequant import BLOCK_DEQUANT
from quire.quantization.formats import format_of_ggml, gguf_format
from quire.quantization.tensor import QuantizedTensor

_MAGIC = b"GGUF"
_SUPPORTED_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
#: GGUF value type -> struct format of one scalar (8 = string, 9 = array are special).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensor:
    """Where one tensor lies, and how it is stored."""

    name: str
    #: Dimensions as GGUF lists them, fastest-varying first (``[in, out]`` for a weight).
    dims: tuple[int, ...]
    #: ``gguf.GGMLQuantizationType`` value.
    qtype: int
    #: uint8 view of the tensor's bytes in the memory map.
    data: np.ndarray
    #: Where those bytes start in the file (-1: not read from a file).
    offset: int = -1

    @property
    def shape(self) -> tuple[int, ...]:
        """Row-major shape (the dims reversed)."""
        return tuple(reversed(self.dims))


@dataclass(frozen=True)
class GGUFIndex:
    """Scalar metadata (arrays left out) and tensor locations of one file."""

    metadata: dict[str, Any]
    tensors: tuple[GGUFTensor, ...]


def read_gguf_index(path: str) -> GGUFIndex:
    """Parse the header of the GGUF file at ``path``.

    :raises ValueError: for a file that is not GGUF, an unsupported version, or a header
        that runs past the end of the file.
    """
    data = np.memmap(path, mode="c")  # copy-on-write: writable views, file never changed
    buf = memoryview(data)
    try:
        header = _Cursor(buf)
        if bytes(buf[:4]) != _MAGIC:
            raise ValueError(f"{path}: not a GGUF file (magic {bytes(buf[:4])!r})")
        header.pos = 4
        version = header.scalar("<I")
        if version not in _SUPPORTED_VERSIONS:
            raise ValueError(f"{path}: GGUF version {version} is not supported (2, 3)")
        n_tensors, n_fields = header.scalar("<Q"), header.scalar("<Q")
        metadata = {}
        for _ in range(n_fields):
            key = header.string()
            value = header.value(header.scalar("<I"))
            if value is not _SKIPPED:
                metadata[key] = value
        infos = [_tensor_info(header) for _ in range(n_tensors)]
    except struct.error as exc:
        raise ValueError(f"{path}: truncated GGUF header ({exc})") from None
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    start = -(-header.pos // alignment) * alignment
    tensors = []
    for name, dims, qtype, offset in infos:
        block, type_size = _block_sizes(qtype)
        nbytes = int(np.prod(dims)) // block * type_size
        begin = start + offset
        if begin + nbytes > data.size:
            raise ValueError(f"{path}: tensor {name!r} runs past the end of the file")
        tensors.append(GGUFTensor(name, dims, qtype, data[begin:begin + nbytes], begin))
    return GGUFIndex(metadata, tuple(tensors))


def dequantize(tensor: GGUFTensor) -> torch.Tensor:
    """The tensor as float32, row-major ``tensor.shape``; shares memory with the map
    for F32 tensors (a copy-on-write page: writing it never reaches the file)."""
    raw = torch.from_numpy(tensor.data)
    fmt = gguf_format(tensor.qtype)
    if fmt is not None and fmt.name == "f32":
        return raw.view(torch.float32).reshape(tensor.shape)
    if fmt is not None:
        return BLOCK_DEQUANT[fmt.name](raw.view(-1, fmt.block_bytes)).reshape(tensor.shape)
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    rows = tensor.data.reshape(int(np.prod(tensor.shape[:-1])), -1)
    return torch.from_numpy(
        gguf_dequantize(rows, GGMLQuantizationType(tensor.qtype))).reshape(tensor.shape)



def _block_sizes(qtype: int) -> tuple[int, int]:
    """Weights per block and bytes per block of GGML type ``qtype``: the types Quire
    runs from its own table, so a start on such a file never imports the ``gguf``
    package (whose import builds classes a start has no use for); the others from
    ``gguf``'s."""
    fmt = gguf_format(qtype)
    if fmt is not None:
        return fmt.block, fmt.block_bytes
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]


# -- header parsing ----------------------------------------------------------------------

_SKIPPED = object()  # array values: not kept


class _Cursor:
    """Reads little-endian values from a buffer, advancing ``pos``."""

    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.pos = 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        text = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return text

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            self.skip_array()
            return _SKIPPED
        fmt = _SCALARS.get(vtype)
        if fmt is None:
            raise ValueError(f"unknown GGUF value type {vtype} at byte {self.pos}")
        return self.scalar(fmt)

    def skip_array(self) -> None:
        vtype, count = self.scalar("<I"), self.scalar("<Q")
        if vtype in _SCALARS:
            self.pos += struct.calcsize(_SCALARS[vtype]) * count
        elif vtype == _STRING:  # variable length: walk the lengths
            for _ in range(count):
                self.pos += 8 + struct.unpack_from("<Q", self.buf, self.pos)[0]
        else:
            for _ in range(count):
                self.value(vtype)


def _tensor_info(header: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    name = header.string()
    n_dims = header.scalar("<I")
    dims = tuple(header.scalar("<Q") for _ in range(n_dims))
    return name, dims, header.scalar("<I"), header.scalar("<Q")


def quantized(tensor: GGUFTensor) -> QuantizedTensor:
    """A 2-D tensor's blocks as they lie in the file (a view of the map, no copy):
    ``[rows, row bytes]`` in its format.

    :raises ValueError: naming the tensor and its type when quire does not run the type.
    """
    fmt = gguf_format(tensor.qtype)
    if fmt is None:  # refused, by the type's GGUF name
        from gguf.constants import GGMLQuantizationType

        fmt = format_of_ggml(tensor.qtype, GGMLQuantizationType(tensor.qtype).name,
                             tensor.name)
    rows, cols = tensor.shape
    data = torch.from_numpy(tensor.data).view(rows, fmt.row_bytes(cols))
    return QuantizedTensor(fmt, data, cols)
