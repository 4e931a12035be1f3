"""BERT: a bidirectional encoder, served as an embedding model (sentence-transformers'
MiniLM and its kin; Hugging Face's ``BertModel``).

It keeps no K/V: a prompt is computed whole in one step, each token attending to every
token of its own sequence (``ctx.ops.bidirectional_attention``), so the engine gives it
no KV tensors (``kv_layer_ids`` is empty). Every sequence is one segment (token type 0),
as sentence-transformers encodes a single text. Post-norm layers: attention, add,
LayerNorm; GELU (erf) MLP, add, LayerNorm. The pooler head of a checkpoint is not used
(sentence-transformers pools the hidden states itself; see :mod:`quire.models.pooling`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from quire.interfaces.communicator import Communicator
from quire.models.context import ForwardContext
from quire.models.layers.embedding import VocabParallelEmbedding
from quire.models.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    whole_param,
)


class _LayerNorm(nn.Module):
    """LayerNorm's parameters; the op is the platform's (``ctx.ops.layer_norm``)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = whole_param(size)
        self.bias = whole_param(size)

    def forward(self, x: torch.Tensor, residual: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        """``LayerNorm(x + residual)``."""
        return ctx.ops.layer_norm(x, self.weight, self.bias, self.eps, residual)[0]


class BertEmbeddings(nn.Module):
    """Word + absolute position + token type 0, then LayerNorm."""

    def __init__(self, config: Any, comm: Communicator) -> None:
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                      comm=comm)
        self.position_embeddings = whole_param(config.max_position_embeddings,
                                          config.hidden_size)
        self.token_type_embeddings = whole_param(config.type_vocab_size, config.hidden_size)
        self.norm_weight = whole_param(config.hidden_size)
        self.norm_bias = whole_param(config.hidden_size)
        self.eps = config.layer_norm_eps

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        x = (self.word_embeddings(input_ids) + F.embedding(positions, self.position_embeddings)
             + self.token_type_embeddings[0])
        return ctx.ops.layer_norm(x, self.norm_weight, self.norm_bias, self.eps)


class BertLayer(nn.Module):
    """Self-attention over the own sequence, then the MLP; each followed by add & norm."""

    def __init__(self, config: Any, comm: Communicator) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.num_heads = heads
        self.head_dim = hidden // heads
        self.scale = self.head_dim ** -0.5
        self.qkv = QKVParallelLinear(hidden, self.head_dim, heads, heads, bias=True,
                                     comm=comm)
        self.attn_out = RowParallelLinear(hidden, hidden, bias=True, comm=comm)
        self.attn_norm = _LayerNorm(hidden, config.layer_norm_eps)
        self.up = ColumnParallelLinear(hidden, config.intermediate_size, bias=True, comm=comm)
        self.down = RowParallelLinear(config.intermediate_size, hidden, bias=True, comm=comm)
        self.out_norm = _LayerNorm(hidden, config.layer_norm_eps)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        batch = ctx.batch
        if batch is None:
            raise ValueError("BERT attends within each sequence: the forward context "
                             "must carry the step's batch")
        t = x.shape[0]
        q, k, v = self.qkv(x).view(t, 3, self.num_heads, self.head_dim).unbind(1)
        attn = ctx.ops.bidirectional_attention(q, k, v, batch.query_start_loc,
                                               batch.query_lens, scale=self.scale)
        h = self.attn_norm(self.attn_out(attn.reshape(t, -1)), x, ctx)
        return self.out_norm(self.down(F.gelu(self.up(h))), h, ctx)


class BertModel(nn.Module):
    """A BERT encoder over a flattened batch: ``forward`` returns the last hidden states
    [T, hidden]; an embedding model, so no logits.

    :raises ValueError: for a tensor-parallel group (not sharded here), or a config this
        implementation does not compute (another activation or position embedding).
    """

    #: Computed whole in one step and kept nowhere: the engine allocates no KV tensors.
    kv_layer_ids: tuple[int, ...] = ()
    is_encoder = True

    def __init__(self, config: Any, comm: Communicator) -> None:
        super().__init__()
        if comm.world_size > 1:
            raise ValueError(f"{type(self).__name__} runs on one rank; use "
                             f"tensor_parallel_size=1 (got {comm.world_size})")
        act = getattr(config, "hidden_act", "gelu")
        if act != "gelu":
            raise ValueError(f"BERT with hidden_act={act!r} is not supported; only 'gelu'")
        kind = getattr(config, "position_embedding_type", "absolute")
        if kind != "absolute":
            raise ValueError(f"BERT with position_embedding_type={kind!r} is not "
                             f"supported; only 'absolute'")
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.embeddings = BertEmbeddings(config, comm)
        self.layers = nn.ModuleList(BertLayer(config, comm)
                                    for _ in range(config.num_hidden_layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        """int64 [T] token ids and positions -> [T, hidden] last hidden states."""
        x = self.embeddings(input_ids, positions, ctx)
        for layer in self.layers:
            x = layer(x, ctx)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """:raises ValueError: always; an encoder has no language-model head."""
        raise ValueError(f"{type(self).__name__} is an embedding model: it has no "
                         f"language-model head to sample from")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Hugging Face BERT names, with or without the ``bert.`` prefix; the pooler
        and any masked-LM head are skipped.

        :raises ValueError: naming a tensor that fits no parameter.
        """
        params = dict(self.named_parameters())
        parts: dict[str, set[str | None]] = {}
        for name, tensor in weights:
            target = _our_name(name.removeprefix("bert."))
            if target is None:
                continue
            ours, shard = target
            param = params.get(ours)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} fits no parameter of "
                                 f"{type(self).__name__}")
            param.weight_loader(param, tensor, *([shard] if shard else []))
            parts.setdefault(ours, set()).add(shard)
        # a fused q/k/v parameter is loaded once all three of its parts came
        return {name for name, got in parts.items() if got == {None} or got == set("qkv")}


#: Hugging Face's names within a layer -> ours (with the fused q/k/v shard).
_LAYER_NAMES = {
    "attention.self.query": ("qkv", "q"),
    "attention.self.key": ("qkv", "k"),
    "attention.self.value": ("qkv", "v"),
    "attention.output.dense": ("attn_out", None),
    "attention.output.LayerNorm": ("attn_norm", None),
    "intermediate.dense": ("up", None),
    "output.dense": ("down", None),
    "output.LayerNorm": ("out_norm", None),
}
_EMBEDDING_NAMES = {
    "embeddings.word_embeddings.weight": "embeddings.word_embeddings.weight",
    "embeddings.position_embeddings.weight": "embeddings.position_embeddings",
    "embeddings.token_type_embeddings.weight": "embeddings.token_type_embeddings",
    "embeddings.LayerNorm.weight": "embeddings.norm_weight",
    "embeddings.LayerNorm.bias": "embeddings.norm_bias",
}


def _our_name(name: str) -> tuple[str, str | None] | None:
    """Our parameter name (and fused shard) for a Hugging Face BERT tensor name; None
    for tensors an encoder does not use (pooler, heads, buffers)."""
    name = name.replace("LayerNorm.gamma", "LayerNorm.weight") \
        .replace("LayerNorm.beta", "LayerNorm.bias")
    if name.startswith("embeddings."):
        ours = _EMBEDDING_NAMES.get(name)
        return None if ours is None else (ours, None)
    if not name.startswith("encoder.layer."):
        return None  # pooler.*, cls.* (a masked-LM head), position_ids
    index, rest = name.removeprefix("encoder.layer.").split(".", 1)
    module, leaf = rest.rsplit(".", 1)
    mapped = _LAYER_NAMES.get(module)
    if mapped is None:
        return (f"layers.{index}.{rest}", None)  # fits nothing: the caller names it
    return (f"layers.{index}.{mapped[0]}.{leaf}", mapped[1])
