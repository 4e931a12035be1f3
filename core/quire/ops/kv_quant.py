"""Quantised KV pages (``kv_cache_dtype`` int8 / fp8): the layout, the write and the read.

Layout. A quantised layer's KV tensor is the paged layout of :mod:`quire.ops.attention`
with ``D + D / 8`` elements per head row instead of ``D``::

    kv_cache: [2, num_blocks, block_size, Hkv, D + D / 8], dtype torch.int8 or
              torch.float8_e4m3fn (one byte an element)
    kv_cache[..., :D]    the quantised head vector q
    kv_cache[..., D:]    the bytes of its D / 16 float16 scales (native byte order),
                         scale g for elements 16 g .. 16 g + 15
    fp8:  value = q * s                  s = absmax(x of the group) / 448
    int8: value = H (q * s)              s = absmax(H x of the group) / 127
          s rounded to float16 (at most 65504); 1 where that is 0

One scale per token, KV head and group of 16, for keys and values alike, written with
the token's K/V (``x / s`` rounded to nearest, even on ties, and clamped to +-127 or
+-448). Per group rather than per row because keys have outlier channels: one scale per
row of 64 left the other channels a coarse grid (``quire bench accuracy``'s figures, per
row, per group and in the Hadamard basis below: docs/quantization.md).

int8 groups are stored in the Hadamard basis: ``H`` is the orthonormal 16 x 16
Sylvester-Hadamard matrix (symmetric, its own inverse; :func:`hadamard16`), applied to
each group before it is quantised and after it is read. An outlier channel is spread over
its 16 and no longer coarsens the grid of the others, which lowers the mean KL of int8
pages against float32 on every real model measured (docs/quantization.md). Attention is unchanged by it:
``H`` is orthogonal, so a kernel may instead rotate each query and each output once
(``(H q) . k' = q . k``). fp8 keeps the plain basis: e4m3's error is relative to each
value, which the rotation does not reduce.

The scales sit beside their row, so a page carries its own scales (prefix caching,
preemption and pipeline stages move pages, never scales), a kernel reads row and scales
from one place, and one head-token costs ``D + D / 8`` bytes: 72 at ``D = 64`` against
256 for float32 (3.56x the tokens) or 128 for bfloat16 (1.78x). ``D`` must be a multiple
of 16. Reads dequantise to float32 (the reference) or the query's dtype.
"""

from __future__ import annotations

import torch

from quire.interfaces.attention import KV_SCALE_GROUP as GROUP
from quire.interfaces.attention import kv_head_size, kv_row_size, kv_scale_bytes
from quire.quantization.hadamard import butterflies

#: The ``kv_cache_dtype`` values, as ``EngineConfig`` takes them.
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "int8", "fp8")
#: The quantised ones, and the element dtype of their pages.
QUANTIZED_KV_DTYPES: dict[str, torch.dtype] = {"int8": torch.int8,
                                               "fp8": torch.float8_e4m3fn}
#: The largest magnitude each quantised dtype stores.
QMAX: dict[torch.dtype, float] = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
#: The largest scale (float16's largest finite value).
SCALE_MAX = 65504.0


def kv_torch_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The element dtype of the KV pages for ``kv_cache_dtype`` ``name``.

    :raises ValueError: for a name not in :data:`KV_CACHE_DTYPES`.
    """
    if name == "auto":
        return model_dtype
    if name in QUANTIZED_KV_DTYPES:
        return QUANTIZED_KV_DTYPES[name]
    if name == "float32":
        return torch.float32
    if name == "bfloat16":
        return torch.bfloat16
    raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                     f"got {name!r}")


def kv_dtype_name(dtype: torch.dtype) -> str:
    """The ``kv_cache_dtype`` name of pages of ``dtype`` (``float16`` for half pages)."""
    for name, quantized in QUANTIZED_KV_DTYPES.items():
        if dtype == quantized:
            return name
    return str(dtype).removeprefix("torch.")


def is_quantized(cache_or_dtype: torch.Tensor | torch.dtype) -> bool:
    """Whether a KV tensor (or its dtype) holds quantised rows with scales."""
    dtype = cache_or_dtype.dtype if isinstance(cache_or_dtype, torch.Tensor) else cache_or_dtype
    return dtype in QMAX


def row_size(head_size: int, dtype: torch.dtype) -> int:
    """Elements of one head row in pages of ``dtype``: ``D``, or ``D + D / 8`` quantised."""
    return kv_row_size(head_size, dtype)


def scale_bytes(head_size: int) -> int:
    """Bytes of the float16 scales after a quantised head row of ``head_size``."""
    return kv_scale_bytes(head_size)


def head_size_of(cache: torch.Tensor) -> int:
    """``D`` of a KV tensor whose last dim is a head row."""
    return kv_head_size(cache.shape[-1], cache.dtype)


def check_head_size(head_size: int) -> None:
    """:raises ValueError: when a head of ``head_size`` cannot take quantised pages."""
    if head_size % GROUP:
        raise ValueError(f"kv_cache_dtype int8/fp8 needs a head size that is a multiple "
                         f"of {GROUP}, got {head_size}")


def hadamard16(groups: torch.Tensor) -> torch.Tensor:
    """``H g`` for every group ``g`` of 16 along the last dim (float32), by
    :func:`~quire.quantization.hadamard.butterflies`: distances 1, 2, 4 and 8, then times
    1/4, the order ``hadamard16`` in the C kernels repeats, so both give the same bits."""
    return butterflies(groups)


def quantize(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``x`` [..., D] (any float dtype, ``D`` a multiple of 16) as quantised rows
    [..., D + D / 8] of ``dtype``'s bytes, seen as uint8 (torch cannot scatter float8 on
    every device)."""
    qmax = QMAX[dtype]
    d = x.shape[-1]
    xf = x.float().reshape(*x.shape[:-1], d // GROUP, GROUP)
    if dtype == torch.int8:
        xf = hadamard16(xf)
    scale = xf.abs().amax(dim=-1, keepdim=True).div_(qmax).clamp_(max=SCALE_MAX).half()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (xf / scale.float()).clamp_(-qmax, qmax)
    if dtype == torch.int8:
        q = q.round_().to(torch.int8)
    else:
        q = q.to(dtype)
    return torch.cat([q.view(torch.uint8).reshape(*x.shape[:-1], d),
                      scale.view(torch.uint8).reshape(*x.shape[:-1], 2 * d // GROUP)], dim=-1)


def dequantize(rows: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Quantised rows [..., D + D / 8] (int8 or float8 pages, or a gather of them) as
    [..., D] of ``out_dtype``; products in float32."""
    d = kv_head_size(rows.shape[-1], rows.dtype)
    if rows.stride(-1) != 1 or (rows.dim() > 1 and rows.stride(-2) % 2):
        rows = rows.contiguous()
    scale = rows[..., d:].view(torch.float16).float()
    values = rows[..., :d].float().reshape(*rows.shape[:-1], d // GROUP, GROUP)
    values = values * scale[..., None]
    if rows.dtype == torch.int8:
        values = hadamard16(values)
    return values.reshape(*rows.shape[:-1], d).to(out_dtype)


def write_rows(cache_half: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """Quantise ``x`` [T, Hkv, D] into ``cache_half`` (keys or values of one layer,
    ``[num_blocks, block_size, Hkv, D + D / 8]``) at ``slots`` [T], in place."""
    rows = cache_half.view(torch.uint8).view(-1, *cache_half.shape[2:])  # a view: writes land
    rows.index_copy_(0, slots.long(), quantize(x, cache_half.dtype))


def write_kv(kv_cache: torch.Tensor, slots: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor) -> None:
    """Quantise one step's keys and values [T, Hkv, D] into their slots."""
    write_rows(kv_cache[0], slots, key)
    write_rows(kv_cache[1], slots, value)


def dequantize_cache(kv_cache: torch.Tensor, out_dtype: torch.dtype = torch.float32
                     ) -> torch.Tensor:
    """A whole quantised layer as float pages ``[2, num_blocks, block_size, Hkv, D]``
    (tests and conformance: the reference read of the same pages)."""
    return dequantize(kv_cache, out_dtype)
