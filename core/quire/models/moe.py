"""Sparse mixture-of-experts decoders: Qwen3-MoE and Mixtral.

Both are the Llama-family decoder (:class:`~quire.models.llama.LlamaAttention`, switched
by a :class:`~quire.models.llama.DecoderVariant`) with the MLP of some or all layers
replaced by a :class:`~quire.models.layers.fused_moe.FusedMoE` block:

- Qwen3-MoE: q/k norm attention as Qwen3, biases from ``attention_bias``, a window on
  every layer when ``use_sliding_window``. A layer is sparse unless it is in
  ``mlp_only_layers`` or ``(layer + 1) % decoder_sparse_step`` is not 0; dense layers run
  a gated MLP of ``intermediate_size``, experts have ``moe_intermediate_size``. The top-k
  weights are renormalised when ``norm_topk_prob``. No shared experts.
- Mixtral: Mistral's attention (no biases, ``sliding_window`` on every layer when set);
  every layer sparse (``num_local_experts``, experts of ``intermediate_size``), top-k
  weights always renormalised.

Checkpoint names as Hugging Face hub checkpoints store them are taken as they are:
``mlp.experts.{e}.gate_proj/up_proj/down_proj`` (Qwen3-MoE) and
``block_sparse_moe.experts.{e}.w1/w3/w2`` (Mixtral; its block is ``mlp`` here, as in
transformers), plus transformers' in-memory stacked ``experts.gate_up_proj`` and
``experts.down_proj``. Fusions and loading as in :mod:`quire.models.llama`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from quire.interfaces.communicator import Communicator
from quire.models.context import ForwardContext
from quire.models.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    default_weight_loader,
    get_rope,
)
from quire.models.layers.fused_moe import FusedMoE
from quire.models.llama import DecoderVariant, LlamaAttention, head_dim_of
from quire.models.pipeline import LayerGap, PipelineStage
from quire.ops.layer_spec import DecoderLayerKernel, DecoderLayerSpec, norm_spec

#: Checkpoint tensor name fragment -> (our fused parameter's fragment, shard id).
_FUSED: dict[str, tuple[str, Any]] = {
    ".q_proj.": (".qkv_proj.", "q"),
    ".k_proj.": (".qkv_proj.", "k"),
    ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}
_FUSED_SHARDS: dict[str, frozenset[Any]] = {
    ".qkv_proj.": frozenset("qkv"),
    ".gate_up_proj.": frozenset({0, 1}),
}
#: One expert's tensor: (block prefix, expert, projection).
_EXPERT = re.compile(r"^(.*)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
#: Projection -> (stacked parameter, part of w13 or None).
_EXPERT_PART: dict[str, tuple[str, int | None]] = {
    "gate_proj": ("w13", 0), "w1": ("w13", 0),
    "up_proj": ("w13", 1), "w3": ("w13", 1),
    "down_proj": ("w2", None), "w2": ("w2", None),
}
#: transformers' stacked experts (every expert in one tensor).
_STACKED = {".experts.gate_up_proj": ".w13", ".experts.down_proj": ".w2"}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def _check_silu(config: PretrainedConfig) -> None:
    act = getattr(config, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"unsupported hidden_act {act!r}; supported: silu")


class DenseMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``, gate and up in one matmul (Qwen3-MoE's dense
    layers)."""

    def __init__(self, hidden_size: int, intermediate_size: int, comm: Communicator) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias=False, comm=comm)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=False,
                                           comm=comm)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.down_proj(ctx.ops.silu_and_mul(self.gate_up_proj(x)))


class MoeDecoderLayer(nn.Module):
    """Pre-norm attention, then a sparse MoE block or a dense MLP, each added to the
    residual stream (the add folded into the next norm, as in the Llama decoder)."""

    def __init__(self, config: PretrainedConfig, layer_idx: int, variant: DecoderVariant,
                 mlp: nn.Module, comm: Communicator) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, variant, comm)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.kernel: DecoderLayerKernel | None = None

    def fusion_spec(self) -> DecoderLayerSpec:
        """This layer as data, for a platform that runs whole layers (``layer.kernel``):
        a dense layer's MLP as its two linear sites, a sparse one as a callable."""
        attn, mlp = self.self_attn, self.mlp
        dense = isinstance(mlp, DenseMLP)
        return DecoderLayerSpec(
            layer_idx=attn.layer_idx, num_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim, scale=attn.scale,
            sliding_window=attn.sliding_window, logits_soft_cap=None,
            input_norm=norm_spec(self.input_layernorm),
            q_norm=None if attn.q_norm is None else norm_spec(attn.q_norm),
            k_norm=None if attn.k_norm is None else norm_spec(attn.k_norm),
            attn_out_norm=None, pre_mlp_norm=norm_spec(self.post_attention_layernorm),
            mlp_out_norm=None, activation="silu", qkv=attn.qkv_proj, o=attn.o_proj,
            gate_up=mlp.gate_up_proj if dense else None,
            down=mlp.down_proj if dense else None,
            world_size=attn.o_proj.comm.world_size, mlp=None if dense else mlp)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                rotary: tuple[torch.Tensor, torch.Tensor], ctx: ForwardContext
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """:returns: (this layer's MLP output, the residual stream before adding it)."""
        if self.kernel is not None:
            done = self.kernel(hidden, residual, rotary, ctx)
            if done is not None:
                return done
        if residual is None:  # first layer: the stream is the embeddings
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rotary, ctx)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden, ctx), residual


class MoeModel(nn.Module):
    """Embedding, decoder layers and final norm (``model.``); with a pipeline ``stage``,
    only that stage's part (other layers are :class:`LayerGap`)."""

    def __init__(self, config: PretrainedConfig, layers: list[nn.Module],
                 comm: Communicator, stage: PipelineStage | None) -> None:
        super().__init__()
        self.stage = stage
        first, last = stage is None or stage.is_first, stage is None or stage.is_last
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                    comm=comm) if first else None)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps) if last else None
        self.rotary_emb = get_rope(config, head_dim_of(config))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        residual: torch.Tensor | None
        if intermediate is None:
            if self.embed_tokens is None:
                raise ValueError("a pipeline stage after the first needs `intermediate`")
            hidden, residual = self.embed_tokens(input_ids), None
        else:
            hidden, residual = intermediate
        rotary = self.rotary_emb(positions, hidden.dtype)
        start, end = ((0, len(self.layers)) if self.stage is None
                      else (self.stage.start, self.stage.end))
        for layer in self.layers[start:end]:
            hidden, residual = layer(hidden, residual, rotary, ctx)
        if self.norm is None:
            assert residual is not None
            return hidden, residual
        hidden, _ = self.norm(hidden, residual)
        return hidden


class MoeForCausalLM(nn.Module):
    """A sparse-MoE causal LM over a flattened batch; subclasses say which layers are
    sparse and how (:meth:`decoder_variant`, :meth:`make_mlp`).

    Same contract as :class:`~quire.models.llama.LlamaForCausalLM`: uninitialised
    parameters until :meth:`load_weights`; :attr:`num_layers`, :attr:`num_kv_heads`,
    :attr:`head_dim` and :attr:`kv_layer_ids` size the KV caches.
    """

    supports_pipeline = True

    def __init__(self, config: PretrainedConfig, comm: Communicator,
                 stage: PipelineStage | None = None) -> None:
        super().__init__()
        _check_silu(config)
        self.config = config
        self.stage = stage
        n = config.num_hidden_layers
        self.variant = self.decoder_variant(config)
        layers = [MoeDecoderLayer(config, i, self.variant, self.make_mlp(config, i, comm), comm)
                  if stage is None or stage.holds(i) else LayerGap() for i in range(n)]
        self.model = MoeModel(config, layers, comm, stage)
        self.kv_layer_ids: tuple[int, ...] = (
            tuple(range(n)) if stage is None else tuple(range(stage.start, stage.end)))
        attn = self.model.layers[self.kv_layer_ids[0]].self_attn
        self.num_layers: int = n
        self.num_kv_heads: int = attn.num_kv_heads
        self.head_dim: int = attn.head_dim
        last = stage is None or stage.is_last
        self.lm_head = (ParallelLMHead(config.vocab_size, config.hidden_size, comm=comm)
                        if last else None)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings and self.lm_head is not None \
                and self.model.embed_tokens is not None:
            self.lm_head.tie_to(self.model.embed_tokens)

    @classmethod
    def decoder_variant(cls, config: PretrainedConfig) -> DecoderVariant:
        """The attention's switches, read from ``config``."""
        raise NotImplementedError

    def make_mlp(self, config: PretrainedConfig, layer_idx: int,
                 comm: Communicator) -> nn.Module:
        """Layer ``layer_idx``'s MLP: a :class:`FusedMoE` or a :class:`DenseMLP`."""
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """:param input_ids: int64 [T]. :param positions: int64 [T].
        :returns: [T, hidden_size] after the final norm; on a pipeline stage before the
            last, (hidden, residual) for the next stage.
        """
        return self.model(input_ids, positions, ctx, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden_size] -> [N, vocab_size] float32 logits (every rank gets all)."""
        if self.lm_head is None:
            raise ValueError("only the last pipeline stage has the LM head")
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy Hugging Face-named tensors into the parameters (this rank's shards).

        :returns: names of the parameters now completely loaded; a fused or stacked
            parameter counts once every part (every expert's) arrived.
        :raises ValueError: naming a tensor that has no parameter here, or whose shape
            does not fit its parameter.
        """
        params = dict(self.named_parameters())
        shards: dict[str, set[Any]] = {}
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if self.tie_word_embeddings and name == "lm_head.weight":
                continue  # the embedding's weight, already loaded under its own name
            staged = self._stage_name(name.replace(".block_sparse_moe.", ".mlp."))
            if staged is None:
                continue  # another pipeline stage's
            target, shard_id = _target(staged)
            param = params.get(target)
            if param is None:
                raise ValueError(
                    f"checkpoint tensor {name!r} has no parameter in {type(self).__name__}")
            loader = getattr(param, "weight_loader", default_weight_loader)
            try:
                if shard_id is None:
                    loader(param, tensor)
                else:
                    loader(param, tensor, shard_id)
            except ValueError as e:
                raise ValueError(f"loading {name!r} into {target!r}: {e}") from None
            if shard_id is None:
                loaded.add(target)
            else:
                shards.setdefault(target, set()).add(shard_id)
        for target, got in shards.items():
            if got >= self._shards_needed(target):
                loaded.add(target)
        return loaded

    def _shards_needed(self, target: str) -> frozenset[Any]:
        module_name, _, param_name = target.rpartition(".")
        if param_name in ("w13", "w2"):
            moe = self.get_submodule(module_name)
            assert isinstance(moe, FusedMoE)
            return moe.expert_shards()[param_name]
        return next(need for f, need in _FUSED_SHARDS.items() if f in target)

    def _stage_name(self, name: str) -> str | None:
        """``name`` as this pipeline stage loads it, or None when another stage does (a
        last stage's tied LM head loads from the embedding's tensor)."""
        stage = self.stage
        if stage is None:
            return name
        if name.startswith("model.layers."):
            return name if stage.holds(int(name.split(".", 3)[2])) else None
        if name.startswith("model.embed_tokens."):
            if stage.is_first:
                return name
            tied_here = self.tie_word_embeddings and stage.is_last
            return name.replace("model.embed_tokens.", "lm_head.") if tied_here else None
        if name.startswith(("model.norm.", "lm_head.")):
            return name if stage.is_last else None
        return name


def _target(name: str) -> tuple[str, Any]:
    """(our parameter's name, shard id or None) for a checkpoint tensor name."""
    expert = _EXPERT.match(name)
    if expert is not None:
        prefix, e, proj = expert.groups()
        param, part = _EXPERT_PART[proj]
        return f"{prefix}.{param}", (int(e) if part is None else (int(e), part))
    for stacked, ours in _STACKED.items():
        if name.endswith(stacked):
            return name[: -len(stacked)] + ours, None
    for fragment, (fused, shard_id) in _FUSED.items():
        if fragment in name:
            return name.replace(fragment, fused), shard_id
    return name, None


class Qwen3MoeForCausalLM(MoeForCausalLM):
    """Qwen3-MoE: Qwen3's attention; sparse layers per ``decoder_sparse_step`` and
    ``mlp_only_layers``."""

    @classmethod
    def decoder_variant(cls, config: PretrainedConfig) -> DecoderVariant:
        bias = bool(getattr(config, "attention_bias", False))
        window = (getattr(config, "sliding_window", None)
                  if getattr(config, "use_sliding_window", False) else None)
        return DecoderVariant(qkv_bias=bias, o_proj_bias=bias, mlp_bias=False, qk_norm=True,
                              sliding_windows=(window,) * config.num_hidden_layers)

    def make_mlp(self, config: PretrainedConfig, layer_idx: int,
                 comm: Communicator) -> nn.Module:
        step = getattr(config, "decoder_sparse_step", 1) or 1
        sparse = (layer_idx not in (getattr(config, "mlp_only_layers", None) or ())
                  and config.num_experts > 0 and (layer_idx + 1) % step == 0)
        if not sparse:
            return DenseMLP(config.hidden_size, config.intermediate_size, comm)
        return FusedMoE(config.num_experts, config.num_experts_per_tok, config.hidden_size,
                        config.moe_intermediate_size,
                        renormalize=bool(getattr(config, "norm_topk_prob", False)), comm=comm)


class MixtralForCausalLM(MoeForCausalLM):
    """Mixtral: Mistral's attention (window on every layer when set); every layer
    sparse, weights renormalised."""

    @classmethod
    def decoder_variant(cls, config: PretrainedConfig) -> DecoderVariant:
        window = getattr(config, "sliding_window", None)
        return DecoderVariant(qkv_bias=False, o_proj_bias=False, mlp_bias=False,
                              qk_norm=False, sliding_windows=(window,) * config.num_hidden_layers)

    def make_mlp(self, config: PretrainedConfig, layer_idx: int,
                 comm: Communicator) -> nn.Module:
        return FusedMoE(config.num_local_experts, config.num_experts_per_tok,
                        config.hidden_size, config.intermediate_size, renormalize=True,
                        comm=comm)
