"""What a model's forward receives besides token ids: the step's attention plumbing.

Passed explicitly down the layers (no global context), so two engines in one process
never see each other's state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from quire.interfaces.attention import AttentionBackend, AttentionBatch
from quire.models.image_blocks import ImageBlocks
from quire.ops import OpSet, reference_ops


@dataclass
class ForwardContext:
    """One step's attention state and the platform's ops, shared by every layer of that
    step."""

    backend: AttentionBackend
    #: Opaque result of ``backend.build_metadata`` for this step.
    metadata: Any
    #: One KV tensor per attention layer, indexed by layer number.
    kv_caches: list[torch.Tensor]
    #: The platform's ops (``Platform.make_ops``); model code calls ``ctx.ops.<op>``.
    ops: OpSet = field(default_factory=reference_ops)
    #: The step's flattened batch (sequence boundaries), for models that attend without
    #: the backend (an encoder's bidirectional attention); None when not given.
    batch: AttentionBatch | None = None
    #: Where this step's K/V go when the backend lets the op set write them
    #: (``AttentionBackend.kv_slots``): layers then call :meth:`rotary_attention`;
    #: None: they rotate, then call :meth:`attention`.
    kv_slots: torch.Tensor | None = field(init=False, default=None)
    #: Image embeddings that take the place of some rows' token embeddings: (int64 rows
    #: [M] of the flattened batch, [M, hidden]); None when the step has none.
    mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None
    #: Image rows that attend over their whole image (a model whose images are
    #: bidirectional blocks: :mod:`quire.models.image_blocks`); None: causal only.
    mm_blocks: ImageBlocks | None = None
    #: An M-RoPE model's (time, height, width) positions, int64 [3, T]; None for other
    #: models (``positions`` alone).
    mrope_positions: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.kv_slots = self.backend.kv_slots(self.metadata)

    def merge_mm(self, embeds: torch.Tensor) -> torch.Tensor:
        """The token embeddings [T, hidden] with :attr:`mm_embeds` in their rows (a text
        decoder calls it right after its embedding: image tokens are embedded there)."""
        if self.mm_embeds is None:
            return embeds
        rows, values = self.mm_embeds
        return embeds.index_copy(0, rows, values.to(embeds.dtype))

    def attention(
        self,
        layer_idx: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        """Write this layer's new K/V into its pages and attend. Shapes as in AttentionBackend.

        :param query: [T, Hq, D]; ``key``/``value``: [T, Hkv, D].
        :returns: [T, Hq, D].
        """
        out = self.backend.forward(
            query,
            key,
            value,
            self.kv_caches[layer_idx],
            self.metadata,
            scale=scale,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
        )
        if self.mm_blocks is not None:
            out = self.mm_blocks.correct(out, query, self.kv_caches[layer_idx], scale=scale,
                                         sliding_window=sliding_window,
                                         logits_soft_cap=logits_soft_cap)
        return out

    def rotary_attention(
        self,
        layer_idx: int,
        qk: torch.Tensor,
        value: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        *,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        """Rotate, write this layer's K/V and attend, where :attr:`kv_slots` is set: the
        rotation and the write in the platform's ``rotary_write_kv`` (one pass on a GPU
        platform), then the backend's ``attend`` alone.

        :param qk: [T, Hq + Hkv, D], query heads then key heads, not yet rotated.
        :param value: [T, Hkv, D]. ``cos``/``sin``: ``RotaryEmbedding.forward``'s.
        :returns: [T, Hq, D].
        :raises ValueError: when the backend named no slots this step.
        """
        if self.kv_slots is None:
            raise ValueError("rotary_attention needs a backend that names the KV slots "
                             "(AttentionBackend.kv_slots); rotate, then call attention()")
        kv_cache = self.kv_caches[layer_idx]
        query = self.ops.rotary_write_kv(qk, value, cos, sin, kv_cache, self.kv_slots)
        out = self.backend.attend(query, kv_cache, self.metadata, scale=scale,
                                  sliding_window=sliding_window,
                                  logits_soft_cap=logits_soft_cap)
        if self.mm_blocks is not None:
            out = self.mm_blocks.correct(out, query, kv_cache, scale=scale,
                                         sliding_window=sliding_window,
                                         logits_soft_cap=logits_soft_cap)
        return out
