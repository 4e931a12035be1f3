"""What a model publishes so that a platform can run its parts its own way.

A platform never imports model classes: it walks ``model.modules()`` and reads what each
module says of itself.

- ``module.op_site == "linear"``: ``F.linear(x, module.weight, module.bias)``; a platform
  may set ``module.kernel`` (``quire.models.layers.linear.LinearKernel``).
- ``module.op_site == "rms_norm"``: :func:`quire.ops.reference.rms_norm` with the module's
  ``weight``, ``eps`` and ``offset``; a platform may set ``module.kernel``
  (``quire.models.layers.norm.NormKernel``).
- ``module.fusion_spec()`` returning a :class:`DecoderLayerSpec`: the decoder layer's
  whole computation as data; a platform may set ``module.kernel`` to a
  :class:`DecoderLayerKernel` that computes it in one go.
- ``module.layers_kernel`` (None until a platform sets it) on a module whose ``layers``
  (an ``nn.ModuleList``) hold its decoder layers in order: a platform may set it to a
  :class:`DecoderStackKernel` that runs consecutive layers in one go.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from quire.models.context import ForwardContext

Activation = Literal["silu", "gelu_tanh"]


@dataclass(frozen=True)
class NormSpec:
    """An RMSNorm: ``(offset + weight) * x / sqrt(mean(x^2) + eps)``."""

    weight: torch.Tensor
    eps: float
    offset: float = 0.0


@dataclass(frozen=True)
class DecoderLayerSpec:
    """A pre-norm decoder layer, as the model runs it op by op::

        h = residual + x                                (x alone on the first layer)
        q, k, v = qkv(input_norm(h))
        q, k = q_norm(q), k_norm(k)                     (per head, when present)
        q, k = rotary(q, k)                             (rotate-half, the step's tables)
        a = o(attention(q, k, v))                       (writes k, v to the cache)
        h = h + attn_out_norm(a)                        (the norm when present)
        y = down(act(gate(m)) * up(m)),  m = pre_mlp_norm(h)
        returns (mlp_out_norm(y), h)                    (the norm when present)

    ``qkv``, ``o``, ``gate_up`` and ``down`` are the layer's linear sites (``op_site ==
    "linear"``; ``qkv`` holds q, k then v rows, ``gate_up`` gate then up). A layer whose
    MLP is no gated pair (mixture of experts) gives ``mlp`` instead, called as
    ``mlp(m, ctx)``, with ``gate_up``/``down`` None and no ``mlp_out_norm``.
    """

    layer_idx: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None
    logits_soft_cap: float | None
    input_norm: NormSpec
    q_norm: NormSpec | None
    k_norm: NormSpec | None
    attn_out_norm: NormSpec | None
    pre_mlp_norm: NormSpec
    mlp_out_norm: NormSpec | None
    activation: Activation
    qkv: nn.Module
    o: nn.Module
    gate_up: nn.Module | None
    down: nn.Module | None
    #: Tensor-parallel ranks sharing the layer; above 1, ``o`` and ``down`` all-reduce.
    world_size: int = 1
    #: The MLP as a callable ``(x, ctx) -> y`` when it is not ``gate_up``/``down``.
    mlp: Callable[[torch.Tensor, ForwardContext], torch.Tensor] | None = None

    def norms(self) -> tuple[NormSpec, ...]:
        """Every norm the layer has."""
        return tuple(n for n in (self.input_norm, self.q_norm, self.k_norm,
                                 self.attn_out_norm, self.pre_mlp_norm, self.mlp_out_norm)
                     if n is not None)


def norm_spec(norm: nn.Module) -> NormSpec:
    """The :class:`NormSpec` of an ``op_site == "rms_norm"`` module."""
    return NormSpec(norm.weight, float(norm.eps), float(getattr(norm, "offset", 0.0)))


class DecoderLayerKernel(Protocol):
    """A platform's own forward for one decoder layer, installed as ``layer.kernel``.

    It computes what the layer's :class:`DecoderLayerSpec` says up to float rounding,
    writing the step's keys and values to the cache as the attention backend would, and
    returns None for a step it does not take (the layer then runs op by op).
    """

    def __call__(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: tuple[torch.Tensor, torch.Tensor],
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(layer output before the residual add, the residual stream), or None."""


class DecoderStackKernel(Protocol):
    """A platform's own forward for consecutive decoder layers, installed as
    ``module.layers_kernel``: what calling layers ``start .. end - 1`` one after the
    other computes, up to float rounding, for the steps it takes. One call instead of a
    call per layer saves a small model's short steps (one sequence decoding) the
    per-layer dispatch. Returns None for a step it does not take (the layers then run
    one by one); a layer whose ``kernel`` was taken away (LoRA's hooks) makes it
    decline.
    """

    def __call__(
        self,
        start: int,
        end: int,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rotaries: Sequence[tuple[torch.Tensor, torch.Tensor]],
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(the last layer's output before the residual add, the residual stream), or
        None; ``rotaries``: each layer's (cos, sin) for the step, in order."""
