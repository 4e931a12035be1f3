"""Float weights quantised on load into Quire's row-scaled formats (``int8``, ``fp8``).

One float32 scale per output row (per output channel, as vLLM's weight-only int8 and
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
