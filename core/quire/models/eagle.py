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
from quire.models.layers import ParallelLMHead, QKVParallelLinear, RMSNorm, get_rope
from quire.models.llama import (
    _FUSED_SHARDS,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    _fused_fragment,
    _fused_target,
    head_dim_of,
    load_tensors,
    num_kv_heads_of,
)
from quire.models.loader import iter_weights, load_model_config

#: Tensors an EAGLE head's checkpoint may hold that the target provides (shared) or
#: that only training used; an EAGLE-3 head shares only the embedding.
_SHARED_PREFIXES = ("embed_tokens.", "lm_head.", "norm.")
_SHARED_PREFIXES_3 = ("embed_tokens.", "t2d")
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
                ctx: ForwardContext, features: torch.Tensor, step: int = 0) -> torch.Tensor:
        """:param input_ids: int64 [T], token ``i + 1`` at row ``i``.
        :param positions: int64 [T], ``i`` (where the head's K/V goes).
        :param features: [T, H], the target's final hidden state at ``i`` (or the head's
            own output there, drafting further).
        :param step: the draft step; the same layers run for every one.
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
        return _load(self, weights, _SHARED_PREFIXES)

    def propose(self, hidden: torch.Tensor) -> torch.Tensor:
        """The argmax token of each row of the head's hidden states."""
        return self.compute_logits(hidden).argmax(dim=-1)

    def target_features(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the head reads of a target forward: its final hidden states."""
        return hidden


def _load(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
          shared: tuple[str, ...]) -> set[str]:
    """Copy a head checkpoint's tensors into ``module``'s parameters (this rank's
    shards), skipping the ``shared`` ones; returns the names of the parameters now
    loaded. :raises ValueError: naming a tensor that fits no parameter."""
    named = ((name, tensor) for name, tensor in
             ((checkpoint_name(n, shared), t) for n, t in weights) if name is not None)
    return load_tensors(module, named, _fused_target,
                        lambda target: _FUSED_SHARDS[_fused_fragment(target)])


class Eagle3Head(nn.Module):
    """EAGLE-3's draft head (Li et al., "EAGLE-3: Scaling up Inference Acceleration of
    Large Language Models via Training-Time Test"): it reads three of the target's
    layers' hidden states, joined by ``fc`` ([3H] -> [H]), and has its own final norm
    and an LM head over a smaller draft vocabulary (``d2t`` maps a draft id to the
    target's: ``id + d2t[id]``).

    Its one layer (``midlayer``) normalises the token's embedding and the hidden state
    apart (``input_layernorm``, ``hidden_norm``) and attends over both side by side
    ([2H] into q, k, v); the residual stream starts from the hidden state. Drafting
    further, its own hidden state before the final norm stands in for ``fc``'s output.
    """

    def __init__(self, config: PretrainedConfig, comm: Communicator) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        variant = LlamaForCausalLM.decoder_variant(config)
        self.fc = nn.Linear(3 * hidden, hidden, bias=False)
        layer = LlamaDecoderLayer(config, 0, variant, comm)
        attn = layer.self_attn
        attn.qkv_proj = QKVParallelLinear(2 * hidden, attn.head_dim,
                                          config.num_attention_heads,
                                          num_kv_heads_of(config), bias=variant.qkv_bias,
                                          comm=comm)
        layer.hidden_norm = RMSNorm(hidden, eps=config.rms_norm_eps)
        self.midlayer = layer
        self.norm = RMSNorm(hidden, eps=config.rms_norm_eps)
        self.draft_vocab_size = int(getattr(config, "draft_vocab_size", None)
                                    or config.vocab_size)
        self.lm_head = ParallelLMHead(self.draft_vocab_size, hidden, comm=comm)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.int64))
        self.rotary_emb = get_rope(config, head_dim_of(config))
        self.num_layers: int = 1
        self.num_kv_heads: int = attn.num_kv_heads
        self.head_dim: int = attn.head_dim
        self._shared: tuple[nn.Module, ...] = ()

    def share(self, target: nn.Module) -> None:
        """Use ``target``'s embedding; read its hidden states at :meth:`aux_layers`."""
        self._shared = (target.model.embed_tokens, target)
        target.model.aux_layers = self.aux_layers(target.config.num_hidden_layers)

    def aux_layers(self, num_target_layers: int) -> tuple[int, ...]:
        """:func:`eagle3_aux_layers` of this head."""
        return eagle3_aux_layers(self.config, num_target_layers)

    def target_features(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the head reads of a target forward: its three layers' inputs, [T, 3H]."""
        return self._shared[1].model.aux_hidden_states

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext, features: torch.Tensor, step: int = 0) -> torch.Tensor:
        """:param features: [T, 3H] the target's (:meth:`target_features`), or [T, H]
            the head's own earlier outputs.
        :param step: the draft step; the same layer runs for every one.
        :returns: [T, H], the hidden states before the final norm."""
        assert self._shared, "share() the target's embedding first"
        layer = self.midlayer
        embeds = self._shared[0](input_ids)
        features = features.to(embeds.dtype)
        residual = self.fc(features) if features.shape[-1] != embeds.shape[-1] else features
        joined = torch.cat((layer.input_layernorm(embeds, ops=ctx.ops),
                            layer.hidden_norm(residual, ops=ctx.ops)), dim=-1)
        hidden = layer.self_attn(joined, self.rotary_emb(positions, embeds.dtype), ctx)
        hidden, residual = layer.post_attention_layernorm(hidden, residual, ctx.ops)
        return layer.mlp(hidden, ctx) + residual

    def propose(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target-vocabulary id of each row's argmax over the draft vocabulary."""
        best = self.lm_head(self.norm(hidden)).argmax(dim=-1)
        return best + self.d2t[best]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """As :meth:`EagleHead.load_weights`; ``d2t`` is a buffer, ``t2d`` unused."""
        weights = list(weights)
        d2t = [t for n, t in weights if n.removeprefix("model.") == "d2t"]
        loaded = _load(self, [(n, t) for n, t in weights
                              if n.removeprefix("model.") != "d2t"], _SHARED_PREFIXES_3)
        if d2t:
            if d2t[0].shape != self.d2t.shape:
                raise ValueError(f"d2t has shape {list(d2t[0].shape)}, for a draft "
                                 f"vocabulary of {self.draft_vocab_size} tokens")
            self.d2t.copy_(d2t[0])
        elif self.draft_vocab_size != self.config.vocab_size:
            raise ValueError(f"no d2t for a draft vocabulary of {self.draft_vocab_size} "
                             f"tokens (the target's has {self.config.vocab_size})")
        return loaded


def checkpoint_name(name: str, shared: tuple[str, ...] = _SHARED_PREFIXES) -> str | None:
    """A head checkpoint's tensor name as the head names it, or None for one the target
    provides (``shared``) or only training used."""
    name = name.removeprefix("model.")
    name = _RENAMED.get(name, name)
    if name.startswith(shared) or name.endswith("rotary_emb.inv_freq"):
        return None
    return name


def eagle3_aux_layers(config: PretrainedConfig, num_target_layers: int) -> tuple[int, ...]:
    """The target layers whose input hidden states (the residual stream) an EAGLE-3
    head with ``config`` reads: its ``eagle_config.eagle_aux_hidden_state_layer_ids``,
    else EAGLE-3's 2, N/2 and N-3 (every pipeline stage needs them, the head's or not).

    :raises ValueError: for ids outside the target's layers."""
    eagle = getattr(config, "eagle_config", None) or {}
    ids = tuple(eagle.get("eagle_aux_hidden_state_layer_ids") or
                (2, num_target_layers // 2, num_target_layers - 3))
    if len(ids) != 3 or not all(0 <= i < num_target_layers for i in ids):
        raise ValueError(f"EAGLE-3 reads three of the target's {num_target_layers} "
                         f"layers, got layer ids {list(ids)}")
    return ids


def load_eagle_head(path: str, comm: Communicator, device: torch.device | str,
                    dtype: torch.dtype, target: nn.Module,
                    eagle3: bool = False) -> EagleHead | Eagle3Head:
    """Build and load the EAGLE (or with ``eagle3``, EAGLE-3) head at ``path`` for
    ``target``, whose embedding (and an EAGLE head's LM head) it shares.

    :raises ValueError: naming ``speculative_config.model``, for a head whose hidden size
        is not the target's, a checkpoint that misses a tensor or has a stray one, or an
        EAGLE-3 head's target layers outside the target.
    """
    config = load_model_config(path)
    target_hidden = target.config.hidden_size
    if config.hidden_size != target_hidden:
        raise ValueError(f"speculative_config.model {path!r}: an EAGLE head of hidden size "
                         f"{config.hidden_size} for a target of {target_hidden}")
    try:
        if eagle3:
            head: EagleHead | Eagle3Head = Eagle3Head(config, comm)
        else:
            names = {checkpoint_name(n) for n, _ in iter_weights(path)}
            head = EagleHead(config, comm, fc_bias="fc.bias" in names)
        head.to(device=device, dtype=dtype)
        loaded = head.load_weights(iter_weights(path))
        head.share(target)
    except ValueError as exc:
        raise ValueError(f"speculative_config.model {path!r}: {exc}") from None
    missing = [n for n, _ in head.named_parameters() if n not in loaded]
    if missing:
        raise ValueError(f"speculative_config.model {path!r}: the EAGLE head checkpoint "
                         f"does not provide {', '.join(missing[:8])}")
    return head.eval()
