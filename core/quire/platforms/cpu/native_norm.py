"""RMSNorm in one C pass (``csrc/rms_norm.c``) for the cpu platform's float32 models.

torch's CPU ``rms_norm`` is six small operators; for the one-row steps of a lone
decoding sequence their dispatch is the cost (~70 us a call, 61 calls a SmolLM2 step).
Results agree with the torch path to float32 rounding (the sum of squares is taken in
another order); the module's own torch path stays the one tests compare bit for bit
with Hugging Face.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from quire.platforms.cpu.native import NativeKernels

logger = logging.getLogger(__name__)


class NativeRMSNorm:
    """One ``rms_norm`` site's forward through the C kernel; Gemma's ``offset + weight``
    is added once, here (in float32 the C product is then the op's)."""

    def __init__(self, native: NativeKernels, norm: nn.Module) -> None:
        self.native = native
        offset = float(getattr(norm, "offset", 0.0))
        weight = norm.weight.detach()
        self.weight = (weight + offset).contiguous() if offset else weight
        self.eps = norm.eps

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None):
        return self.native.rms_norm(x, self.weight, self.eps, residual)


def install_norm_kernels(model: nn.Module, native: NativeKernels) -> int:
    """Give every float32 host ``rms_norm`` site of ``model`` (``quire.ops.layer_spec``)
    a :class:`NativeRMSNorm`.

    :returns: how many norms got one.
    """
    installed = 0
    for module in model.modules():
        if (getattr(module, "op_site", None) == "rms_norm"
                and module.weight.dtype == torch.float32
                and module.weight.device.type == "cpu"):
            module.kernel = NativeRMSNorm(native, module)
            installed += 1
    logger.info("cpu platform: %d RMSNorms run in C", installed)
    return installed
