"""Building blocks the model files compose: sharded linears, the vocabulary, norm, rotary.

Every layer that holds a shard of a checkpoint tensor knows its shard: it takes the
:class:`~quire.interfaces.communicator.Communicator` of its tensor-parallel group, sizes its
parameters for ``comm.rank`` of ``comm.world_size``, and attaches to each parameter a
``weight_loader(param, loaded, shard_id=None)`` that cuts the full checkpoint tensor down
to that shard. A model's ``load_weights`` therefore stays generic: it finds the parameter
and calls its loader.

==============  ==========================================================================
``linear``      column-/row-parallel linears; fused QKV and gate/up projections; the
                ``LinearKernel`` a platform may install in place of ``F.linear``
``embedding``   vocabulary-parallel embedding and LM head
``norm``        RMSNorm, with the residual add folded in
``mlp``         the gated MLP (SiLU or GELU-tanh through the platform's op)
``rotary``      rotary position embedding: inverse frequencies per rope type, cos/sin cache
==============  ==========================================================================
"""

from quire.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from quire.models.layers.linear import (
    ColumnParallelLinear,
    LinearKernel,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    default_weight_loader,
)
from quire.models.layers.mlp import GatedMLP
from quire.models.layers.norm import RMSNorm
from quire.models.layers.rotary import RotaryEmbedding, apply_rotary, get_rope

__all__ = [
    "ColumnParallelLinear",
    "GatedMLP",
    "LinearKernel",
    "MergedColumnParallelLinear",
    "ParallelLMHead",
    "QKVParallelLinear",
    "RMSNorm",
    "RotaryEmbedding",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "apply_rotary",
    "default_weight_loader",
    "get_rope",
]
