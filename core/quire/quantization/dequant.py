"""Every format back to float32, in torch: the reference each kernel is held to.

For GGUF's types these are the float32 operations of ``gguf.quants`` in the same order
(an f16 scale times the integer values, plus the f16 minimum for Q4_1/Q5_1; for the
K-quants, the f16 super-block scale times each sub-block's integer scale first, then
times the values, minus the sub-block minimum), so the results are bit for bit those of
the reference loader; torch runs them on whole tensors, on any device.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from quire.quantization.tensor import QuantizedTensor


def dequantize_rows(weight: QuantizedTensor) -> torch.Tensor:
    """``weight`` as float32 ``[rows, cols]``."""
    fmt = weight.format
    rows = weight.data.contiguous()
    if fmt.row_scaled:
        return _ROW_VALUES[fmt.name](rows) * weight.scale.unsqueeze(1)
    blocks = rows.view(-1, fmt.block_bytes)
    return BLOCK_DEQUANT[fmt.name](blocks).reshape(weight.rows, weight.cols)


def _f16_column(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """Bytes ``start:start+2`` of every block as an f16 scale, float32 ``[n, 1]``."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """``[n, k]`` bytes -> ``[n, 2k]``: all low nibbles, then all high ones (ggml order)."""
    return torch.cat((packed & 0x0F, packed >> 4), dim=1)


def _bits(packed: torch.Tensor, width: int) -> torch.Tensor:
    """``[n, k]`` bytes -> ``[n, k * 8 / width]`` fields of ``width`` bits, each byte's
    lowest field first: bit ``i`` of a little-endian word is element ``i`` (width 1)."""
    shifts = torch.arange(0, 8, width, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & ((1 << width) - 1)).flatten(1)


def _shifts(values: list[int], shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8, device=like.device).view(shape)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    q = (_nibbles(blocks[:, 2:]).to(torch.int8) - 8).float()
    return _f16_column(blocks, 0) * q


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, 4:]).float()
    return _f16_column(blocks, 0) * q + _f16_column(blocks, 2)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, 6:]) | (_bits(blocks[:, 2:6], 1) << 4)
    return _f16_column(blocks, 0) * (q.to(torch.int8) - 16).float()


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    q = (_nibbles(blocks[:, 8:]) | (_bits(blocks[:, 4:8], 1) << 4)).float()
    return _f16_column(blocks, 0) * q + _f16_column(blocks, 2)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    q = blocks[:, 2:].contiguous().view(torch.int8).float()
    return q * _f16_column(blocks, 0)


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
    shifts = _shifts([0, 4], (1, 1, 2, 1), qs)
    return ((qs.reshape(n, 4, 1, 32) >> shifts) & 0x0F).reshape(n, 8, 32)


def _q2_k(blocks: torch.Tensor) -> torch.Tensor:
    # scales[16] (4-bit scale, 4-bit min), qs[64] (2 bits), d f16, dmin f16
    n = blocks.shape[0]
    scales = blocks[:, :16]
    d, dmin = _f16_column(blocks, 80), _f16_column(blocks, 82)
    dl = (d * (scales & 0x0F).float()).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).float()).reshape(n, 16, 1)
    q = (blocks[:, 16:80].reshape(n, 2, 1, 32) >> _shifts([0, 2, 4, 6], (1, 1, 4, 1),
                                                          blocks)) & 3
    return (dl * q.reshape(n, 16, 16).float() - ml).reshape(n, 256)


def _q3_k(blocks: torch.Tensor) -> torch.Tensor:
    # hmask[32], qs[64], scales[12] (16 six-bit signed scales, offset 32), d f16
    n = blocks.shape[0]
    hmask, qs, packed = blocks[:, :32], blocks[:, 32:96], blocks[:, 96:108]
    d = _f16_column(blocks, 108)
    low = (packed[:, :8].reshape(n, 1, 8) >> _shifts([0, 4], (1, 2, 1), blocks)).reshape(n, 16)
    high = (packed[:, 8:12].reshape(n, 1, 4)
            >> _shifts([0, 2, 4, 6], (1, 4, 1), blocks)).reshape(n, 16)
    sc = ((low & 0x0F) | ((high & 0x03) << 4)).to(torch.int8) - 32
    dl = (d * sc.float()).reshape(n, 16, 1)
    ql = (qs.reshape(n, 2, 1, 32) >> _shifts([0, 2, 4, 6], (1, 1, 4, 1), blocks)) & 3
    qh = (hmask.reshape(n, 1, 1, 32) >> _shifts(list(range(8)), (1, 1, 8, 1), blocks)) & 1
    q = ql.reshape(n, 16, 16).to(torch.int8) - ((qh.reshape(n, 16, 16) ^ 1) << 2).to(torch.int8)
    return (dl * q.float()).reshape(n, 256)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    scale, minimum = _k_scales(blocks, 4)
    q = _k_low_nibbles(blocks[:, 16:]).float()
    return (scale * q - minimum).reshape(-1, 256)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    scale, minimum = _k_scales(blocks, 4)
    shifts = torch.arange(8, dtype=torch.uint8, device=blocks.device).view(1, 1, 8, 1)
    high = ((blocks[:, 16:48].reshape(n, 1, 1, 32) >> shifts) & 1).reshape(n, 8, 32)
    q = (_k_low_nibbles(blocks[:, 48:]) | (high << 4)).float()
    return (scale * q - minimum).reshape(-1, 256)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    low_shifts = _shifts([0, 4], (1, 1, 2, 1), blocks)
    low = ((blocks[:, :128].reshape(n, 2, 1, 64) >> low_shifts) & 0x0F).reshape(n, 8, 32)
    high_shifts = _shifts([0, 2, 4, 6], (1, 1, 4, 1), blocks)
    high = ((blocks[:, 128:192].reshape(n, 2, 1, 32) >> high_shifts) & 0x03).reshape(n, 8, 32)
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
    d = (_f16_column(blocks, 208) * scales).unsqueeze(-1)
    return (d * q).reshape(-1, 256)


#: GGUF formats: ``[n, block_bytes]`` uint8 blocks -> ``[n, block]`` float32.
BLOCK_DEQUANT: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "f32": lambda b: b.contiguous().view(torch.float32),
    "f16": lambda b: b.contiguous().view(torch.float16).float(),
    "bf16": lambda b: b.contiguous().view(torch.bfloat16).float(),
    "q4_0": _q4_0, "q4_1": _q4_1, "q5_0": _q5_0, "q5_1": _q5_1, "q8_0": _q8_0,
    "q2_k": _q2_k, "q3_k": _q3_k, "q4_k": _q4_k, "q5_k": _q5_k, "q6_k": _q6_k,
}
#: Row-scaled formats: ``[rows, cols]`` uint8 -> the unscaled float32 values.
_ROW_VALUES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "int8": lambda rows: rows.view(torch.int8).float(),
    "fp8_e4m3": lambda rows: rows.view(torch.float8_e4m3fn).float(),
}
