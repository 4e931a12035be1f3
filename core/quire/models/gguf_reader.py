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

Dequantisation does the same float32 operations as ``gguf.quants`` in the same order
(an f16 scale times the integer values, plus the f16 minimum for Q4_1/Q5_1; for the
K-quants Q4_K/Q5_K/Q6_K, the f16 super-block scale times each sub-block's integer scale
first, then times the values, minus the sub-block minimum), so the results are bit for
bit those of the reference loader; torch just runs them on whole tensors.
Types without a torch path here go through ``gguf.quants.dequantize``.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

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
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

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
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
        nbytes = int(np.prod(dims)) // block * type_size
        begin = start + offset
        if begin + nbytes > data.size:
            raise ValueError(f"{path}: tensor {name!r} runs past the end of the file")
        tensors.append(GGUFTensor(name, dims, qtype, data[begin:begin + nbytes]))
    return GGUFIndex(metadata, tuple(tensors))


def dequantize(tensor: GGUFTensor) -> torch.Tensor:
    """The tensor as float32, row-major ``tensor.shape``; shares memory with the map
    for F32 tensors (a copy-on-write page: writing it never reaches the file)."""
    from gguf.constants import GGMLQuantizationType

    qtype = GGMLQuantizationType(tensor.qtype)
    raw = torch.from_numpy(tensor.data)
    convert = _TORCH_DEQUANT.get(qtype.name)
    if convert is not None:
        return convert(raw).reshape(tensor.shape)
    from gguf.quants import dequantize as gguf_dequantize

    rows = tensor.data.reshape(int(np.prod(tensor.shape[:-1])), -1)
    return torch.from_numpy(gguf_dequantize(rows, qtype)).reshape(tensor.shape)


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


# -- dequantisation (same float32 ops, same order, as gguf.quants) ------------------------

def _f16_column(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """Bytes ``start:start+2`` of every block as an f16 scale, float32 ``[n, 1]``."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """``[n, k]`` bytes -> ``[n, 2k]``: all low nibbles, then all high ones (ggml order)."""
    return torch.cat((packed & 0x0F, packed >> 4), dim=1)


def _q4_0(raw: torch.Tensor) -> torch.Tensor:
    blocks = raw.view(-1, 18)
    q = (_nibbles(blocks[:, 2:]).to(torch.int8) - 8).float()
    return _f16_column(blocks, 0) * q


def _q4_1(raw: torch.Tensor) -> torch.Tensor:
    blocks = raw.view(-1, 20)
    q = _nibbles(blocks[:, 4:]).float()
    return _f16_column(blocks, 0) * q + _f16_column(blocks, 2)


def _q8_0(raw: torch.Tensor) -> torch.Tensor:
    blocks = raw.view(-1, 34)
    q = blocks[:, 2:].contiguous().view(torch.int8).float()
    return q * _f16_column(blocks, 0)


def _bits(packed: torch.Tensor, width: int) -> torch.Tensor:
    """``[n, k]`` bytes -> ``[n, k * 8 / width]`` fields of ``width`` bits, each byte's
    lowest field first: bit ``i`` of a little-endian word is element ``i`` (width 1)."""
    shifts = torch.arange(0, 8, width, dtype=torch.uint8)
    return ((packed.unsqueeze(-1) >> shifts) & ((1 << width) - 1)).flatten(1)


def _q5_0(raw: torch.Tensor) -> torch.Tensor:
    blocks = raw.view(-1, 22)
    q = _nibbles(blocks[:, 6:]) | (_bits(blocks[:, 2:6], 1) << 4)
    return _f16_column(blocks, 0) * (q.to(torch.int8) - 16).float()


def _q5_1(raw: torch.Tensor) -> torch.Tensor:
    blocks = raw.view(-1, 24)
    q = (_nibbles(blocks[:, 8:]) | (_bits(blocks[:, 4:8], 1) << 4)).float()
    return _f16_column(blocks, 0) * q + _f16_column(blocks, 2)


def _k_scales(blocks: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: the 8 six-bit scales and minima packed in 12 bytes from ``start``,
    each ``[n, 8, 1]`` float32, already multiplied by the block's f16 ``d``/``dmin``."""
    packed = blocks[:, start:start + 12].reshape(-1, 3, 4)
    d, m, m_d = packed[:, 0], packed[:, 1], packed[:, 2]
    sc = torch.cat((d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)), dim=1)
    mn = torch.cat((m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)), dim=1)
    scale = (_f16_column(blocks, 0) * sc.float()).unsqueeze(-1)
    minimum = (_f16_column(blocks, 2) * mn.float()).unsqueeze(-1)
    return scale, minimum


def _k_low_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``[n, 128]`` bytes -> ``[n, 8, 32]``: each 32-byte run gives two sub-blocks, its
    low nibbles then its high ones."""
    n = qs.shape[0]
    shifts = torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1)
    return ((qs.reshape(n, 4, 1, 32) >> shifts) & 0x0F).reshape(n, 8, 32)


def _q4_k(raw: torch.Tensor) -> torch.Tensor:
    blocks = raw.view(-1, 144)
    scale, minimum = _k_scales(blocks, 4)
    q = _k_low_nibbles(blocks[:, 16:]).float()
    return (scale * q - minimum).reshape(-1, 256)


def _q5_k(raw: torch.Tensor) -> torch.Tensor:
    blocks = raw.view(-1, 176)
    n = blocks.shape[0]
    scale, minimum = _k_scales(blocks, 4)
    shifts = torch.arange(8, dtype=torch.uint8).view(1, 1, 8, 1)
    high = ((blocks[:, 16:48].reshape(n, 1, 1, 32) >> shifts) & 1).reshape(n, 8, 32)
    q = (_k_low_nibbles(blocks[:, 48:]) | (high << 4)).float()
    return (scale * q - minimum).reshape(-1, 256)


def _q6_k(raw: torch.Tensor) -> torch.Tensor:
    blocks = raw.view(-1, 210)
    n = blocks.shape[0]
    low_shifts = torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1)
    low = ((blocks[:, :128].reshape(n, 2, 1, 64) >> low_shifts) & 0x0F).reshape(n, 8, 32)
    high_shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
    high = ((blocks[:, 128:192].reshape(n, 2, 1, 32) >> high_shifts) & 0x03).reshape(n, 8, 32)
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
    d = (_f16_column(blocks, 208) * scales).unsqueeze(-1)
    return (d * q).reshape(-1, 256)


_TORCH_DEQUANT: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "F32": lambda raw: raw.view(torch.float32),
    "F16": lambda raw: raw.view(torch.float16).float(),
    "BF16": lambda raw: raw.view(torch.bfloat16).float(),
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q8_0": _q8_0,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
}
