"""EAGLE's draft head (Li et al., "EAGLE: Speculative Sampling Requires Rethinking
Feature Uncertainty"): a Llama decoder layer that reads the target's last hidden states.

At position ``i`` the head takes the embedding of token ``i + 1`` and the target's final
hidden state (after its norm) at ``i``, joins them through ``fc`` ([2H] -> [H]), runs
its decoder layers (the first without its input norm) and gives a hidden state whose
logits under the target's LM head predict token ``i + 2``. Drafting further, its own
output stands in for the target's hidden state. It shares the target's embedding and
LM head.

Checkpoints in the EAGLE project's layout load as published: a directory with a Llama
``config.json`` (``num_hidden_layers`` of the head, usually 1) and ``fc.weight``
(``fc.bias`` where trained with one), ``layers.N.*`` in Hugging Face's Llama names, and
an ``embed_tokens.weight`` that is ignored; the ``speculators`` names
(``fusion_fc.*``) and a ``model.`` prefix are read too.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from quire.interfaces.communicator import Communicator
from quire.models.context import ForwardContext
from quire.models.layers import default_weight_loader, get_rope
from quire.models.llama import (
    _FUSED_SHARDS,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    _fused_fragment,
    _fused_target,
    head_dim_of,
)
from quire.models.loader import iter_weights, load_model_config

#: Tensors a head's checkpoint may hold that the target provides (shared) or that only
#: training used.
_SHARED_PREFIXES = ("embed_tokens.", "lm_head.", "norm.")
_RENAMED = {"fusion_fc.weight": "fc.weight", "fusion_fc.bias": "fc.bias"}


class _NoNorm(nn.Module):
    """EAGLE's first layer has no input norm: the joined features go in as they are
    (the first layer's norm is only called without a residual)."""

    def forward(self, x: torch.Tensor, ops: object = None) -> torch.Tensor:
        return x


class EagleHead(nn.Module):
    """The head's own layers; :meth:`share` gives it the target's embedding and LM head.

    Attributes for its KV cache, as a model's: :attr:`num_layers`, :attr:`num_kv_heads`
    (on this rank), :attr:`head_dim`.
    """

    def __init__(self, config: PretrainedConfig, comm: Communicator, fc_bias: bool) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        variant = LlamaForCausalLM.decoder_variant(config)
        self.fc = nn.Linear(2 * hidden, hidden, bias=fc_bias)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, variant, comm)
                                    for i in range(config.num_hidden_layers))
        self.layers[0].input_layernorm = _NoNorm()
        self.rotary_emb = get_rope(config, head_dim_of(config))
        attn = self.layers[0].self_attn
        self.num_layers: int = config.num_hidden_layers
        self.num_kv_heads: int = attn.num_kv_heads
        self.head_dim: int = attn.head_dim
        # the target's modules, held in a tuple so that they are not this module's
        # submodules (not moved, counted or loaded with it)
        self._shared: tuple[nn.Module, ...] = ()

    def share(self, target: nn.Module) -> None:
        """Use ``target``'s embedding and LM head (a Llama-family causal LM's)."""
        self._shared = (target.model.embed_tokens, target)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext, features: torch.Tensor) -> torch.Tensor:
        """:param input_ids: int64 [T], token ``i + 1`` at row ``i``.
        :param positions: int64 [T], ``i`` (where the head's K/V goes).
        :param features: [T, H], the target's final hidden state at ``i`` (or the head's
            own output there, drafting further).
        :returns: [T, H], the head's hidden states (:meth:`compute_logits` reads them)."""
        assert self._shared, "share() the target's embedding first"
        embeds = self._shared[0](input_ids)
        hidden = self.fc(torch.cat((embeds, features.to(embeds.dtype)), dim=-1))
        rotary = self.rotary_emb(positions, hidden.dtype)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, rotary, ctx)
        assert residual is not None
        return hidden + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's LM head over the head's hidden states: float32 [N, vocab]."""
        assert self._shared, "share() the target's LM head first"
        return self._shared[1].compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy a head checkpoint's tensors in (this rank's shards); returns the names
        of the parameters now loaded. :raises ValueError: naming a tensor that fits no
        parameter."""
        params = dict(self.named_parameters())
        shards: dict[str, set[object]] = {}
        loaded: set[str] = set()
        for name, tensor in weights:
            name = checkpoint_name(name)
            if name is None:
                continue
            target, shard_id = _fused_target(name)
            param = params.get(target)
            if param is None:
                raise ValueError(f"EAGLE head tensor {name!r} has no parameter here")
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
            if got >= _FUSED_SHARDS[_fused_fragment(target)]:
                loaded.add(target)
        return loaded


def checkpoint_name(name: str) -> str | None:
    """A head checkpoint's tensor name as :class:`EagleHead` names it, or None for one
    the target provides (embedding, LM head) or only training used."""
    name = name.removeprefix("model.")
    name = _RENAMED.get(name, name)
    if name.startswith(_SHARED_PREFIXES) or name.endswith("rotary_emb.inv_freq"):
        return None
    return name


def load_eagle_head(path: str, comm: Communicator, device: torch.device | str,
                    dtype: torch.dtype, target: nn.Module) -> EagleHead:
    """Build and load the head at ``path`` for ``target`` (whose embedding and LM head it
    shares).

    :raises ValueError: naming ``speculative_config.model``, for a head whose hidden size
        is not the target's, or a checkpoint that misses a tensor or has a stray one.
    """
    config = load_model_config(path)
    target_hidden = target.config.hidden_size
    if config.hidden_size != target_hidden:
        raise ValueError(f"speculative_config.model {path!r}: an EAGLE head of hidden size "
                         f"{config.hidden_size} for a target of {target_hidden}")
    names = {checkpoint_name(n) for n, _ in iter_weights(path)}
    head = EagleHead(config, comm, fc_bias="fc.bias" in names)
    head.to(device=device, dtype=dtype)
    try:
        loaded = head.load_weights(iter_weights(path))
    except ValueError as exc:
        raise ValueError(f"speculative_config.model {path!r}: {exc}") from None
    missing = [n for n, _ in head.named_parameters() if n not in loaded]
    if missing:
        raise ValueError(f"speculative_config.model {path!r}: the EAGLE head checkpoint "
                         f"does not provide {', '.join(missing[:8])}")
    head.share(target)
    return head.eval()
