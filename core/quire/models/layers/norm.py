"""RMSNorm as Llama/Qwen (``weight``) and Gemma (``1 + weight``) define it, with the
decoder's residual add folded in."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from quire.ops import reference

if TYPE_CHECKING:
    from quire.ops import OpSet


class NormKernel(Protocol):
    """A platform's own :meth:`RMSNorm.forward` for one loaded norm.

    Installed as ``norm.kernel`` by ``Platform.prepare_model``; it must compute what the
    module computes up to float rounding, and may return None for inputs it does not
    take (the module then runs its torch operations).
    """

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
        """Same arguments and results as :meth:`RMSNorm.forward`, or None."""


class RMSNorm(nn.Module):
    """``weight * (x / sqrt(mean(x^2) + eps))`` over the last dimension.

    The statistics are taken in float32 whatever the input dtype, and the normalised
    value is cast back to the input dtype *before* the weight multiplies it: the same
    operations, in the same order, as Hugging Face's ``LlamaRMSNorm``, so float32 results
    agree to rounding and half-precision ones round the same way. Not sharded: every
    rank holds the whole weight.
    """

    #: What a platform may run its own way (``quire.ops.layer_spec``).
    op_site = "rms_norm"

    def __init__(self, hidden_size: int, eps: float = 1e-6, offset: float = 0.0) -> None:
        """:param offset: added to the weight (1.0 for Gemma's ``(1 + weight)``); the
            product is then taken in float32 and cast, as Gemma does."""
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.kernel: NormKernel | None = None

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None,
        ops: OpSet | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalise ``x``; with ``residual``, normalise ``x + residual`` instead.

        :param x: [..., hidden_size].
        :param residual: the running residual stream, same shape and dtype as ``x``.
        :param ops: the platform's ops (``ctx.ops``), whose ``rms_norm`` runs the norm
            and the add (a GPU platform's fused kernel); None: the reference.
        :returns: the normalised tensor; with ``residual``, also the new residual
            ``x + residual``. That add is the one a decoder layer does between its
            sublayers, computed as the same single add, so folding it here changes no
            bit of the result.
        """
        if self.kernel is not None:
            done = self.kernel(x, residual)
            if done is not None:
                return done
        # float32 without offset, the reference is torch's fused kernel: the same
        # operations in the same order (bit-identical; tests/unit/test_models.py checks it)
        rms_norm = reference.rms_norm if ops is None else ops.rms_norm
        return rms_norm(x, self.weight, self.eps, residual, offset=self.offset)

    def extra_repr(self) -> str:
        offset = f", offset={self.offset}" if self.offset else ""
        return f"{self.weight.shape[0]}, eps={self.eps}{offset}"
