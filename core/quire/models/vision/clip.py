"""CLIP's vision tower (Hugging Face's ``CLIPVisionModel``), as LLaVA reads it.

Patches are embedded by a strided convolution, a class token is prepended and learned
positions added, then pre-norm encoder layers attend within each image
(``ctx.ops``'s ``bidirectional_attention`` over the images flattened into one batch,
so images of several requests run as one call). Only the layers up to the deepest one a
model reads are built: LLaVA reads the second to last, and ``post_layernorm`` never.
Linears are tensor-parallel like the decoder's: heads and the MLP split over the ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from quire.interfaces.communicator import Communicator
from quire.models.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    whole_param,
)
from quire.ops import OpSet

#: Hugging Face activation names -> the function (the vision towers' and projectors').
ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
}


def activation(name: str, where: str) -> Any:
    """The activation ``name``; :raises ValueError: naming ``where`` it was asked for."""
    if name not in ACTIVATIONS:
        raise ValueError(f"{where}={name!r} is not supported; supported: "
                         f"{', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class LayerNormParams(nn.Module):
    """A LayerNorm's weight and bias; the op is the platform's (``ops.layer_norm``)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = whole_param(size)
        self.bias = whole_param(size)

    def forward(self, x: torch.Tensor, ops: OpSet) -> torch.Tensor:
        return ops.layer_norm(x, self.weight, self.bias, self.eps)


class CLIPEncoderLayer(nn.Module):
    """``x + attn(ln1(x))``, then ``+ mlp(ln2(.))``, over images flattened to [T, D]."""

    def __init__(self, config: Any, comm: Communicator) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.head_dim = hidden // heads
        self.scale = self.head_dim ** -0.5
        self.layer_norm1 = LayerNormParams(hidden, config.layer_norm_eps)
        self.qkv = QKVParallelLinear(hidden, self.head_dim, heads, heads, bias=True,
                                     comm=comm)
        self.num_heads = self.qkv.num_heads  # on this rank
        self.out_proj = RowParallelLinear(hidden, hidden, bias=True, comm=comm)
        self.layer_norm2 = LayerNormParams(hidden, config.layer_norm_eps)
        self.fc1 = ColumnParallelLinear(hidden, config.intermediate_size, bias=True,
                                        comm=comm)
        self.fc2 = RowParallelLinear(config.intermediate_size, hidden, bias=True, comm=comm)
        self.act = activation(config.hidden_act, "vision_config.hidden_act")

    def forward(self, x: torch.Tensor, starts: torch.Tensor, lens: Sequence[int],
                ops: OpSet) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv(self.layer_norm1(x, ops)).view(
            t, 3, self.num_heads, self.head_dim).unbind(1)
        attn = ops.bidirectional_attention(q, k, v, starts, lens, scale=self.scale)
        x = x + self.out_proj(attn.reshape(t, -1))
        return x + self.fc2(self.act(self.fc1(self.layer_norm2(x, ops))))


class CLIPVisionTower(nn.Module):
    """Pixels [N, 3, H, W] -> the hidden states of the layers in ``feature_layers``
    (Hugging Face's ``hidden_states`` indices: 0 is the embeddings after
    ``pre_layrnorm``, -1 the last layer's output), joined on the last dim: [N, S, D * k].

    :raises ValueError: for a feature layer the tower does not have.
    """

    def __init__(self, config: Any, comm: Communicator,
                 feature_layers: Sequence[int]) -> None:
        super().__init__()
        total = config.num_hidden_layers
        self.feature_layers = [f if f >= 0 else total + 1 + f for f in feature_layers]
        if not all(0 <= f <= total for f in self.feature_layers):
            raise ValueError(f"vision_feature_layer {list(feature_layers)} is outside the "
                             f"vision tower's {total} layers")
        hidden = config.hidden_size
        self.patch_size = config.patch_size
        self.image_size = config.image_size
        self.num_patches = (config.image_size // config.patch_size) ** 2
        self.class_embedding = whole_param(hidden)
        self.patch_embedding = whole_param(hidden, config.num_channels, config.patch_size,
                                      config.patch_size)
        self.position_embedding = whole_param(self.num_patches + 1, hidden)
        self.pre_layrnorm = LayerNormParams(hidden, config.layer_norm_eps)
        self.layers = nn.ModuleList(CLIPEncoderLayer(config, comm)
                                    for _ in range(max(self.feature_layers)))

    def forward(self, pixel_values: torch.Tensor, ops: OpSet) -> torch.Tensor:
        n, _, h, w = pixel_values.shape
        if (h, w) != (self.image_size, self.image_size):
            raise ValueError(f"the vision tower takes {self.image_size}x{self.image_size} "
                             f"pixels, got {h}x{w}")
        weight = self.patch_embedding
        patches = F.conv2d(pixel_values.to(weight.dtype), weight, stride=self.patch_size)
        x = torch.cat([self.class_embedding.expand(n, 1, -1),
                       patches.flatten(2).transpose(1, 2)], dim=1) + self.position_embedding
        seq = x.shape[1]
        x = self.pre_layrnorm(x.reshape(n * seq, -1), ops)
        lens = [seq] * n
        starts = torch.arange(0, (n + 1) * seq, seq, device=x.device)
        kept = {0: x} if 0 in self.feature_layers else {}
        for i, layer in enumerate(self.layers, start=1):
            x = layer(x, starts, lens, ops)
            if i in self.feature_layers:
                kept[i] = x
        return torch.cat([kept[f] for f in self.feature_layers], dim=-1).view(n, seq, -1)

    @staticmethod
    def checkpoint_name(name: str) -> tuple[str, str | None] | None:
        """Our (parameter name, q/k/v shard) for a tower tensor's Hugging Face name
        (without the tower's prefix); None for one we never read (``post_layernorm``)."""
        name = name.removeprefix("vision_model.")
        if name.startswith("post_layernorm.") or name == "embeddings.position_ids":
            return None
        if name.startswith("embeddings."):
            leaf = name.removeprefix("embeddings.").removesuffix(".weight")
            return leaf, None
        if name.startswith("pre_layrnorm."):
            return name, None
        name = name.removeprefix("encoder.")
        for ours, shard in (("self_attn.q_proj.", "q"), ("self_attn.k_proj.", "k"),
                            ("self_attn.v_proj.", "v")):
            if ours in name:
                return name.replace(ours, "qkv."), shard
        return name.replace("self_attn.out_proj.", "out_proj.").replace("mlp.", ""), None

    def layer_of(self, name: str) -> int | None:
        """The encoder layer our parameter ``name`` belongs to, or None."""
        return int(name.split(".")[1]) if name.startswith("layers.") else None
