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
``experts.down_proj``. Everything else is :class:`~quire.models.llama.LlamaForCausalLM`'s:
the decoder layer (given the block as its MLP), the model, pipeline stages and loading
(through its ``make_mlp``, ``checkpoint_name``, ``parameter_of`` and ``shards_needed``).
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn
from transformers import PretrainedConfig

from quire.interfaces.communicator import Communicator
from quire.models.layers import GatedMLP
from quire.models.layers.fused_moe import FusedMoE
from quire.models.llama import DecoderVariant, LlamaForCausalLM, _fused_target
from quire.models.pipeline import PipelineStage

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


def _check_silu(config: PretrainedConfig) -> None:
    act = getattr(config, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"unsupported hidden_act {act!r}; supported: silu")


class DenseMLP(GatedMLP):
    """``down(silu(gate(x)) * up(x))``, no biases (Qwen3-MoE's dense layers)."""

    def __init__(self, hidden_size: int, intermediate_size: int, comm: Communicator) -> None:
        super().__init__(hidden_size, intermediate_size, "silu", bias=False, comm=comm)


class MoeForCausalLM(LlamaForCausalLM):
    """A sparse-MoE causal LM over a flattened batch; subclasses say which layers are
    sparse and how (:meth:`decoder_variant`, :meth:`make_mlp`). Same contract as
    :class:`~quire.models.llama.LlamaForCausalLM`."""

    def __init__(self, config: PretrainedConfig, comm: Communicator,
                 stage: PipelineStage | None = None) -> None:
        _check_silu(config)  # the experts' activation, which no dense layer may check
        super().__init__(config, comm, stage)

    def checkpoint_name(self, name: str) -> str:
        return name.replace(".block_sparse_moe.", ".mlp.")

    def parameter_of(self, name: str) -> tuple[str, Any]:
        expert = _EXPERT.match(name)
        if expert is not None:
            prefix, e, proj = expert.groups()
            param, part = _EXPERT_PART[proj]
            return f"{prefix}.{param}", (int(e) if part is None else (int(e), part))
        for stacked, ours in _STACKED.items():
            if name.endswith(stacked):
                return name[: -len(stacked)] + ours, None
        return _fused_target(name)

    def shards_needed(self, target: str) -> frozenset[Any]:
        module_name, _, param_name = target.rpartition(".")
        if param_name in ("w13", "w2"):
            moe = self.get_submodule(module_name)
            if not isinstance(moe, FusedMoE):
                raise ValueError(f"{target!r}: stacked experts outside a FusedMoE block")
            return moe.expert_shards()[param_name]
        return super().shards_needed(target)


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
