"""The ops a GPU platform takes from the core's Triton kernels into its
:class:`~quire.ops.OpSet`: :func:`triton_ops` names them for ``OpSet.with_ops``.

Importing this module does not import triton: a platform names these functions in
``make_ops()`` at engine build, and the kernels (and triton) are imported on an op's
first call, as the attention backend does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import torch

from quire.kernels.triton_moe_op import fused_moe
from quire.quantization.tensor import QuantizedTensor


def triton_ops() -> dict[str, Callable[..., Any]]:
    """Op name -> Triton implementation, for
    ``reference_ops().with_ops("triton", **triton_ops())``."""
    return {"rms_norm": rms_norm, "silu_and_mul": silu_and_mul,
            "gelu_tanh_and_mul": gelu_tanh_and_mul, "rotary_write_kv": rotary_write_kv,
            "fused_moe": fused_moe, "quantized_linear": quantized_linear,
            "lora_linear": lora_linear}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, *, offset: float = 0.0
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`quire.ops.reference.rms_norm`'s contract, residual add and offset in the
    same kernel."""
    return _kernels().rms_norm(x, weight, eps, residual, offset=offset)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """:func:`quire.ops.reference.silu_and_mul`'s contract, in one kernel."""
    kernels = _kernels()
    return kernels.gated(x, kernels.SILU)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """:func:`quire.ops.reference.gelu_tanh_and_mul`'s contract, in one kernel."""
    kernels = _kernels()
    return kernels.gated(x, kernels.GELU_TANH)


def rotary_write_kv(qk: torch.Tensor, value: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, kv_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> torch.Tensor:
    """:func:`quire.ops.reference.rotary_write_kv`'s contract, rotation and KV write in
    one kernel (a negative slot is padding and not written)."""
    return _kernels().rotary_write_kv(qk, value, cos, sin, kv_cache, slot_mapping)


def quantized_linear(x: torch.Tensor, weight: QuantizedTensor,
                     bias: torch.Tensor | None = None, *,
                     int8_activations: bool = False) -> torch.Tensor:
    """:func:`quire.ops.quantized.quantized_linear`'s contract: the weight's blocks
    dequantised in registers and multiplied in one kernel (split-K GEMV for a decode
    row), or w8a8 on int8 ``tl.dot``."""
    from quire.kernels import triton_quant

    return triton_quant.quantized_linear(x, weight, bias, int8_activations=int8_activations)


def lora_linear(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                offsets: Sequence[int], token_slots: torch.Tensor,
                segments: object = None) -> torch.Tensor:
    """:func:`quire.ops.lora.lora_linear`'s contract in a shrink and an expand kernel, one
    program per token (BGMV), nothing read back to the host; ``y`` is updated in place.
    ``segments`` (the host's grouping) is not needed: the kernels read the slots."""
    from quire.kernels import triton_lora

    return triton_lora.lora_linear(y, x, a, b, offsets, token_slots)


def _kernels() -> ModuleType:
    from quire.kernels import triton_fused

    return triton_fused
