"""What the engine needs from a model implementation (core or plugin-provided)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import torch

from quire.models.context import ForwardContext


@runtime_checkable
class CausalLM(Protocol):
    """A causal language model over a flattened batch, built as ``cls(hf_config, comm)``.

    Attributes size the KV cache: one tensor per attention layer, each holding
    ``num_kv_heads`` heads (on this rank) of ``head_dim``.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """int64 [T] token ids and positions -> [T, hidden] final hidden states."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> float32 [N, vocab], the full vocabulary on every rank."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load Hugging Face-named tensors; returns the parameter names fully loaded."""
