"""Quantised weights: block formats kept as stored (GGUF) or made on load (int8, fp8).

``formats`` (the layouts and their ids), ``tensor`` (:class:`QuantizedTensor`, a weight
in one format), ``dequant`` (each format back to float32 in torch: every kernel's
oracle), ``quantize`` (float weights into Q8_0 blocks or the row-scaled formats),
``methods`` (the ``quantization`` and ``quantization_config`` options and what each
method does to a model).
"""

from quire.quantization.formats import FORMATS, QuantFormat, format_named
from quire.quantization.tensor import QuantizedTensor

__all__ = ["FORMATS", "QuantFormat", "QuantizedTensor", "format_named"]
