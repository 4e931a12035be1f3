"""The gated MLP of most decoder families: ``down(act(gate(x)) * up(x))``."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from quire.interfaces.communicator import Communicator
from quire.models.layers.linear import MergedColumnParallelLinear, RowParallelLinear

if TYPE_CHECKING:
    from quire.models.context import ForwardContext

#: Activations by name -> the op (on ``ctx.ops``) that applies one to a gate/up pair.
ACTIVATION_OPS = {"silu": "silu_and_mul", "gelu_tanh": "gelu_tanh_and_mul"}


class GatedMLP(nn.Module):
    """Gate and up fused into one column-parallel product, the activation-and-product
    through the platform's op, then the row-parallel down product.

    :param activation: ``"silu"`` (Llama, Qwen, Mistral) or ``"gelu_tanh"`` (Gemma).
    :raises ValueError: naming the activation when it is neither.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str, *,
                 bias: bool, comm: Communicator) -> None:
        super().__init__()
        if activation not in ACTIVATION_OPS:
            raise ValueError(f"unsupported activation {activation!r}; supported: "
                             f"{', '.join(ACTIVATION_OPS)}")
        self.activation = activation
        self._op = ACTIVATION_OPS[activation]
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size], bias=bias, comm=comm)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias,
                                           comm=comm)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.down_proj(getattr(ctx.ops, self._op)(self.gate_up_proj(x)))
