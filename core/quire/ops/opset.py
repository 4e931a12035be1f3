""":class:`OpSet`: one callable per op, the reference unless a platform replaced it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any

from quire.ops import lora, moe, pooling, quantized, reference


@dataclass(frozen=True)
class OpSet:
    """The ops a platform provides; see :mod:`quire.ops.reference` for each contract.

    Immutable: a platform builds its own with :meth:`with_ops`, and two engines in one
    process never share a mutable table.
    """

    rms_norm: Callable[..., Any] = reference.rms_norm
    layer_norm: Callable[..., Any] = reference.layer_norm
    silu_and_mul: Callable[..., Any] = reference.silu_and_mul
    gelu_tanh_and_mul: Callable[..., Any] = reference.gelu_tanh_and_mul
    #: Rotary embedding fused with the layer's KV write; models call it only where the
    #: attention backend names the slots (``AttentionBackend.kv_slots``).
    rotary_write_kv: Callable[..., Any] = reference.rotary_write_kv
    #: Embedding models (:mod:`quire.ops.pooling`): one vector per sequence, and an
    #: encoder's attention within each sequence.
    pool: Callable[..., Any] = pooling.pool
    bidirectional_attention: Callable[..., Any] = pooling.bidirectional_attention
    #: Mixture of experts (:mod:`quire.ops.moe`): routing, then the experts it chose.
    select_experts: Callable[..., Any] = moe.select_experts
    fused_moe: Callable[..., Any] = moe.fused_moe
    #: Products on quantised weights (:mod:`quire.ops.quantized`): a linear layer whose
    #: weight is a ``QuantizedTensor`` runs on it, one call per stored part.
    quantized_linear: Callable[..., Any] = quantized.quantized_linear
    #: LoRA adapters' per-token updates of a product (:mod:`quire.ops.lora`).
    lora_linear: Callable[..., Any] = lora.lora_linear
    #: Which implementation runs each op (``"reference"`` or the platform's name for
    #: its own), for logs and the native-ops test.
    sources: tuple[tuple[str, str], ...] = field(default=())

    def with_ops(self, source: str, **ops: Callable[..., Any]) -> OpSet:
        """A copy with ``ops`` replaced, each recorded as coming from ``source``.

        :raises ValueError: naming an op this set does not have.
        """
        known = {f.name for f in fields(self)} - {"sources"}
        unknown = sorted(set(ops) - known)
        if unknown:
            raise ValueError(f"unknown ops {', '.join(unknown)}; known: "
                             f"{', '.join(sorted(known))}")
        kept = tuple((name, src) for name, src in self.sources if name not in ops)
        return replace(self, **ops, sources=kept + tuple((n, source) for n in sorted(ops)))

    def source_of(self, op: str) -> str:
        """Who implements ``op``: a platform's label, or ``"reference"``."""
        return dict(self.sources).get(op, "reference")


def reference_ops() -> OpSet:
    """Every op in plain torch: the oracle, and what a platform without its own runs."""
    return OpSet()
