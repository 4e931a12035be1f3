"""Float weights quantised on load: into GGUF's Q8_0 blocks (``int8`` and ``w8a8`` by
default, :func:`quantize_groups`) or Quire's row-scaled formats (``int8`` with
``group_size: -1``, ``fp8``; :func:`quantize_rows`).

Q8_0: each 32 weights of a row take ``d = max |w| / 127`` rounded to float16, and
``round(w / d)`` with that float16 ``d`` (so every weight is within ``d / 2`` of
``d * q``; llama.cpp divides by the float32 ``d`` before rounding it, which adds up to
127 float16 roundings of ``d``); an all-zero group gets ``d = 0``.

Rows: one float32 scale per output row (per output channel, as vLLM's weight-only int8 and
its dynamic fp8 do): ``int8`` takes ``scale = max |w| / 127`` and rounds ``w / scale``
to the nearest integer; ``fp8`` takes ``scale = max |w| / 448`` (e4m3's largest
finite value) and rounds ``w / scale`` to the nearest e4m3 value. A row of zeros gets
scale 1. Computed in float32, one weight (one tensor-parallel shard) at a time, so the
peak is that weight's float32 copy.
"""

from __future__ import annotations

import torch

from quire.quantization.formats import FORMATS
from quire.quantization.tensor import QuantizedTensor

_FP8_MAX = 448.0
_GROUP = 32
#: Largest ``max |w|`` of a Q8_0 group: its scale must be a finite float16.
_F16_MAX_AMAX = 65504.0 * 127


def quantize_groups(weight: torch.Tensor) -> QuantizedTensor:
    """``weight`` (``[rows, cols]``, any float dtype, ``cols`` a multiple of 32) in
    ``q8_0``: int8 per 32 weights of a row with a float16 scale.

    :raises ValueError: a row not a whole number of 32-weight groups, or a group too
        large for a float16 scale.
    """
    w = weight.detach().float()
    if w.dim() != 2 or w.shape[1] % _GROUP:
        raise ValueError(f"q8_0 needs a 2-D weight of whole {_GROUP}-weight groups, got "
                         f"{tuple(w.shape)}")
    groups = w.reshape(w.shape[0], -1, _GROUP)
    amax = groups.abs().amax(dim=2, keepdim=True)
    if amax.numel() and float(amax.max()) > _F16_MAX_AMAX:
        raise ValueError(f"q8_0: a weight of magnitude {float(amax.max()):.3g} does not fit "
                         "a float16 scale; quantise per output row (group_size -1)")
    d = (amax / 127).half()
    df = d.float()
    q = torch.round(groups / torch.where(df > 0, df, 1.0)).clamp_(-127, 127).to(torch.int8)
    blocks = torch.cat((d.view(torch.uint8), q.view(torch.uint8)), dim=2)
    return QuantizedTensor(FORMATS["q8_0"], blocks.reshape(w.shape[0], -1).contiguous(),
                           w.shape[1])


def quantize_rows(weight: torch.Tensor, format_name: str) -> QuantizedTensor:
    """``weight`` (``[rows, cols]``, any float dtype) in ``int8`` or ``fp8_e4m3``."""
    w = weight.detach().float()
    if w.dim() != 2:
        raise ValueError(f"need a 2-D weight, got {tuple(w.shape)}")
    amax = w.abs().amax(dim=1)
    if format_name == "int8":
        scale = torch.where(amax > 0, amax / 127, 1.0)
        q = torch.round(w / scale.unsqueeze(1)).clamp_(-127, 127).to(torch.int8)
    elif format_name == "fp8_e4m3":
        scale = torch.where(amax > 0, amax / _FP8_MAX, 1.0)
        q = (w / scale.unsqueeze(1)).clamp_(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
    else:
        raise ValueError(f"quantize_rows: {format_name!r} is not a row format")
    return QuantizedTensor(FORMATS[format_name], q.view(torch.uint8).contiguous(),
                           w.shape[1], scale.float().contiguous())
