"""SigLIP's vision encoder with Idefics3's variable-resolution embeddings (Hugging Face's
``Idefics3VisionTransformer``, also SmolVLM's).

Patches are embedded by a strided convolution with a bias; each patch's learned position
is looked up by bucketing its fractional place in the image's unpadded patch grid onto
the encoder's native grid (the NaViT scheme), so a tile of any size reuses the native
position table. Pre-norm encoder layers (CLIP's, :class:`CLIPEncoderLayer`) attend within
each image through ``ops.bidirectional_attention`` over the images flattened into one
batch, and a final LayerNorm closes the tower. Linears are tensor-parallel like CLIP's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from quire.interfaces.communicator import Communicator
from quire.models.layers.linear import whole_param
from quire.models.vision.clip import CLIPEncoderLayer, CLIPVisionTower, LayerNormParams
from quire.ops import OpSet


def bucketed_position_ids(mask: torch.Tensor, per_side: int) -> torch.Tensor:
    """Position ids [N, h * w] of patch grids ``mask`` [N, h, w] on a native grid of
    ``per_side`` x ``per_side`` positions; padded patches take position 0.

    The float arithmetic is transformers' own, op for op (``Idefics3VisionEmbeddings``):
    a patch on a bucket boundary must land where it lands there."""
    n, h, w = mask.shape
    device = mask.device
    boundaries = torch.arange(1 / per_side, 1.0, 1 / per_side, device=device,
                              dtype=torch.float32)
    step_h = 1.0 / mask[:, :, 0].sum(dim=1)
    step_w = 1.0 / mask[:, 0, :].sum(dim=1)
    coords_h = torch.arange(h, device=device, dtype=torch.float32)[None, :] * step_h[:, None]
    coords_w = torch.arange(w, device=device, dtype=torch.float32)[None, :] * step_w[:, None]
    bucket_h = torch.bucketize(torch.clamp(coords_h, max=1.0 - 1e-6), boundaries, right=True)
    bucket_w = torch.bucketize(torch.clamp(coords_w, max=1.0 - 1e-6), boundaries, right=True)
    ids = (bucket_h[:, :, None] * per_side + bucket_w[:, None, :]).reshape(n, -1)
    return torch.where(mask.reshape(n, -1), ids, torch.zeros_like(ids))


class PatchEmbedding(nn.Module):
    """A ``patch_size``-strided convolution with a bias: pixels -> [N, h * w, D]."""

    def __init__(self, hidden: int, channels: int, patch_size: int) -> None:
        super().__init__()
        self.patch_size = patch_size
        self.weight = whole_param(hidden, channels, patch_size, patch_size)
        self.bias = whole_param(hidden)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = F.conv2d(pixel_values.to(self.weight.dtype), self.weight, self.bias,
                           stride=self.patch_size)
        return patches.flatten(2).transpose(1, 2)


class SiglipVisionTower(nn.Module):
    """Images [N, 3, H, W] of one size -> the last hidden states after
    ``post_layernorm``, [N, (H/p) * (W/p), D].

    Every patch is taken as real (the caller checks): padded ones would need a key mask
    the op set's attention does not take, and Idefics3's processors tile without padding.
    """

    def __init__(self, config: Any, comm: Communicator, bucketed: bool = True) -> None:
        """:param bucketed: positions by Idefics3's bucketing (tiles of any size);
            False: the plain SigLIP's, position ``i`` for patch ``i`` of an image at the
            tower's native size (Gemma 3's)."""
        super().__init__()
        self.bucketed = bucketed
        hidden = config.hidden_size
        self.patch_size = config.patch_size
        self.per_side = config.image_size // config.patch_size
        self.patch_embedding = PatchEmbedding(hidden, config.num_channels, config.patch_size)
        self.position_embedding = whole_param(self.per_side ** 2, hidden)
        self.layers = nn.ModuleList(CLIPEncoderLayer(config, comm)
                                    for _ in range(config.num_hidden_layers))
        self.post_layernorm = LayerNormParams(hidden, config.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor, ops: OpSet) -> torch.Tensor:
        n, _, h, w = pixel_values.shape
        x = self.patch_embedding(pixel_values)
        if self.bucketed:
            grid = torch.ones(1, h // self.patch_size, w // self.patch_size,
                              dtype=torch.bool, device=x.device)
            x = x + F.embedding(bucketed_position_ids(grid, self.per_side),
                                self.position_embedding)
        elif (h, w) != (self.per_side * self.patch_size,) * 2:
            raise ValueError(f"the vision tower takes {self.per_side * self.patch_size} "
                             f"pixels square, got {h}x{w}")
        else:
            x = x + self.position_embedding
        seq = x.shape[1]
        x = x.reshape(n * seq, -1)
        lens = [seq] * n
        starts = torch.arange(0, (n + 1) * seq, seq, device=x.device)
        for layer in self.layers:
            x = layer(x, starts, lens, ops)
        return self.post_layernorm(x, ops).view(n, seq, -1)

    @staticmethod
    def checkpoint_name(name: str) -> tuple[str, str | None]:
        """Our (parameter name, q/k/v shard) for a tower tensor's Hugging Face name
        (without the tower's prefix).

        :raises ValueError: for a name the tower has no parameter for."""
        name = name.removeprefix("vision_model.")
        if name.startswith("embeddings."):
            leaf = name.removeprefix("embeddings.")
            if leaf == "position_embedding.weight":
                return "position_embedding", None
            if leaf.startswith("patch_embedding."):
                return leaf, None
        elif name.startswith("post_layernorm."):
            return name, None
        elif name.startswith("encoder.layers."):
            mapped = CLIPVisionTower.checkpoint_name(name)
            if mapped is not None:
                return mapped
        raise ValueError(f"vision tensor {name!r} has no parameter in the SigLIP tower")
