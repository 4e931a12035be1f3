"""What every image-text model shares: a text decoder of ours (``language_model``) whose
forward, logits and KV-cache attributes are the model's own; the subclass adds its
vision side and ``embed_images``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from quire.models.context import ForwardContext


class ImageTextModel(nn.Module):
    """Base of the image-text models: call :meth:`_adopt` with the built decoder."""

    supports_pipeline = True

    def _adopt(self, language_model: nn.Module) -> None:
        """Take ``language_model`` as the text decoder: its layers size the KV cache."""
        self.language_model = language_model
        self.kv_layer_ids: tuple[int, ...] = language_model.kv_layer_ids
        self.num_layers: int = language_model.num_layers
        self.num_kv_heads: int = language_model.num_kv_heads
        self.head_dim: int = language_model.head_dim

    @staticmethod
    def text_name(name: str) -> str | None:
        """The decoder's name for a checkpoint tensor of the text model
        (``language_model.model.*``, ``language_model.*``, ``lm_head.*``; the in-memory
        ``model.`` prefix already removed), or None for the vision side's."""
        if name.startswith("language_model."):
            inner = name.removeprefix("language_model.")
            return inner if inner.startswith(("model.", "lm_head.")) else "model." + inner
        return name if name.startswith("lm_head.") else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None) -> Any:
        """The decoder's forward; image rows come in through ``ctx.mm_embeds``."""
        return self.language_model(input_ids, positions, ctx, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)
