"""What a model's forward receives besides token ids: the step's attention plumbing.

Passed explicitly down the layers (no global context), so two engines in one process
never see each other's state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from quire.interfaces.attention import AttentionBackend, AttentionBatch
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
        return self.backend.forward(
            query,
            key,
            value,
            self.kv_caches[layer_idx],
            self.metadata,
            scale=scale,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
        )
