"""The ``quantization`` option: what each method keeps in memory and how it multiplies.

| method | weights | activations in the product |
| --- | --- | --- |
| ``gguf`` | a GGUF file's blocks as stored, tensor by tensor (mixed files too) | the model dtype (float32 or bfloat16), float32 sums |
| ``int8`` | int8, an f16 scale per 32 weights of a row (GGUF's Q8_0 blocks), quantised on load; or a float32 scale per output row (``group_size: -1``) | the model dtype, float32 sums |
| ``w8a8`` | as ``int8``, of ``W H`` (each group of 32 turned by the Hadamard matrix ``H``: :mod:`quire.quantization.hadamard`) | int8 per token of ``H x``: per 32 values of a row (llama.cpp's Q8 activations; ``max |x| / 127`` each), integer products per 32, the block scales applied in float; with ``group_size: -1``, per whole row and int32 sums |
| ``fp8`` | float8 e4m3, a float32 scale per output row, quantised on load | the model dtype (weight-only: dequantised in the product) |
| ``none`` | the model dtype (a GGUF file's blocks expanded on load) | the model dtype |

``gguf`` quantises every linear layer and the embedding (the LM head too: each is what
the file holds). The methods that quantise on load leave the embedding and the LM head
in the model dtype, as vLLM does, and apply to the linear layers of dense and attention
blocks, not to a mixture of experts' stacked experts (which stay in the model dtype).

``quantization_config`` (:class:`QuantizationConfig`) sets the groups of ``int8`` and
``w8a8``: 32 weights along a row by default, since one scale per output row loses most
on rows whose values span very different ranges (weights that were 4-bit blocks), and
int8 in 32-weight groups is GGUF's Q8_0 format, which every platform already multiplies.

Which methods a platform runs is its ``Platform.quantizations`` (plugin API 1.3).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

#: Every method, in the order ``--help`` lists them.
METHODS: tuple[str, ...] = ("none", "gguf", "int8", "w8a8", "fp8")
#: Methods that quantise a float checkpoint's linear weights on load, and into what.
ON_LOAD_FORMATS = {"int8": "int8", "w8a8": "int8", "fp8": "fp8_e4m3"}
#: Methods whose weights take ``group_size``.
GROUPED_METHODS = ("int8", "w8a8")
#: Weights per scale along a row: GGUF's Q8_0 block; -1 is one scale per output row
#: (GPTQ's and llm-compressor's spelling of per-channel).
GROUP_SIZES = (32, -1)
#: The format of ``int8`` weights in 32-weight groups.
GROUPED_FORMAT = "q8_0"


@dataclass(frozen=True)
class QuantizationConfig:
    """``quantization_config``: how the methods that quantise on load do it. Given as a
    dict or JSON text too (``--quantization-config '{"group_size": -1}'``); every error
    names the field (``quantization_config.X``)."""

    #: Weights of a row that share one scale (``int8``, ``w8a8``): 32 (GGUF's Q8_0
    #: blocks; ``w8a8``'s activations then take a scale per 32 values too) or -1 (one
    #: float32 scale per output row, and per token for ``w8a8``'s activations).
    group_size: int = 32
    #: ``w8a8`` only: weights and rows turned by Hadamard groups of 32 before they are
    #: quantised (:mod:`quire.quantization.hadamard`: a lower error for one small float32
    #: product per layer product, figures in docs/quantization.md); False keeps the
    #: plain basis and its speed.
    hadamard: bool = True

    def __post_init__(self) -> None:
        size = self.group_size
        if isinstance(size, bool) or size not in GROUP_SIZES:
            raise ValueError(f"quantization_config.group_size must be 32 (a scale per 32 "
                             f"weights) or -1 (one per output row), got {size!r}")
        if not isinstance(self.hadamard, bool):
            raise ValueError(f"quantization_config.hadamard must be true or false, got "
                             f"{self.hadamard!r}")

    @classmethod
    def parse(cls, value: Any) -> QuantizationConfig:
        """``value`` as given: a :class:`QuantizationConfig`, a dict or JSON text.

        :raises ValueError: naming the option or the field.
        """
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"quantization_config must be a JSON object: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"quantization_config must be a JSON object, got {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"quantization_config: unknown key(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        return cls(**value)


@dataclass(frozen=True)
class Quantization:
    """A settled method, as the model loader and the layers read it."""

    method: str
    #: weights per scale of ``int8`` and ``w8a8`` (``QuantizationConfig.group_size``)
    group_size: int = 32
    #: ``w8a8`` in the Hadamard basis (``QuantizationConfig.hadamard``)
    hadamard: bool = True

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    @property
    def on_load_format(self) -> str | None:
        """The format float weights are quantised into on load, or None."""
        if self.method in GROUPED_METHODS and self.group_size == 32:
            return GROUPED_FORMAT
        return ON_LOAD_FORMATS.get(self.method)

    @property
    def int8_activations(self) -> bool:
        return self.method == "w8a8"

    @property
    def rotates(self) -> bool:
        """Whether weights quantised on load (and their products' rows) are turned by
        Hadamard groups of 32: ``w8a8`` unless ``hadamard`` is off."""
        return self.int8_activations and self.hadamard


def check_method(value: object) -> None:
    """:raises ValueError: naming the methods, for anything else (None is ``auto``)."""
    if value is not None and value not in METHODS:
        raise ValueError(f"quantization must be one of {', '.join(METHODS)} (or unset: gguf "
                         f"for a .gguf file, none otherwise), got {value!r}")


def resolve_method(requested: str | None, *, gguf_file: bool,
                   checkpoint_quantization: str | None, platform_name: str,
                   platform_methods: tuple[str, ...],
                   config: QuantizationConfig | None = None) -> Quantization:
    """The method for a checkpoint: ``requested``, or its default (``gguf`` for a GGUF
    file, ``none`` otherwise), checked against the checkpoint and the platform.

    :param checkpoint_quantization: the ``quant_method`` of a checkpoint's own
        ``quantization_config`` (a GPTQ, AWQ or fp8 checkpoint), or None.
    :raises ValueError: naming the option, for a method that contradicts the file or
        that the platform does not run.
    """
    config = config or QuantizationConfig()
    check_method(requested)
    method = requested or ("gguf" if gguf_file else "none")
    if checkpoint_quantization is not None:
        raise ValueError(f"quantization: the checkpoint is already quantised "
                         f"({checkpoint_quantization}, its config's quantization_config), "
                         f"which quire does not load; use its float checkpoint with "
                         f"quantization=int8, w8a8 or fp8, or a GGUF file")
    if gguf_file and method not in ("gguf", "none"):
        raise ValueError(f"quantization: {method} quantises a float checkpoint on load, but "
                         f"this is a GGUF file, whose tensors are already quantised: use "
                         f"gguf (its blocks as stored) or none (expanded to float)")
    if not gguf_file and method == "gguf":
        raise ValueError("quantization: gguf keeps a GGUF file's blocks, but this "
                         "checkpoint is not a .gguf file; use int8, w8a8, fp8 or none")
    if method not in platform_methods:
        raise ValueError(f"quantization: {method} is not run by the '{platform_name}' "
                         f"platform; it runs {', '.join(platform_methods)}")
    return Quantization(method, config.group_size, config.hadamard)
