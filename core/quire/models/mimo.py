"""Xiaomi MiMo: a Qwen2 model whose checkpoint carries its own multi-token-prediction
(MTP) layers, and the draft head built from them (``speculative_config.method: "mtp"``).

The target is Qwen2 as it is (:class:`MiMoForCausalLM`); the checkpoint's
``model.mtp_layers.{i}.*`` (``config.num_nextn_predict_layers`` of them) are left to
:class:`MiMoMTPHead`. An MTP layer at position ``i`` reads the embedding of token
``i + 1`` (zero at position 0) and the target's final hidden state (after its norm) at
``i``: each through its own norm (``token_layernorm``, ``hidden_layernorm``), joined as
[hidden, embedding] by ``input_proj`` ([2H] -> [H]), one Qwen2 decoder layer
(``mtp_block``, stored under the layer's own prefix), then ``final_layernorm``; the
target's LM head over the result predicts token ``i + 2``. It shares the target's
embedding and LM head, and drafts the way an EAGLE head does
(:class:`~quire.executor.drafter.EagleDrafter`): draft step ``j`` answers with MTP layer
``j``, and with the last layer again for every step past the checkpoint's layers (as
vLLM reuses its MTP layers when ``num_speculative_tokens`` exceeds them).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

import torch
from torch import nn
from transformers import PretrainedConfig

from quire.interfaces.communicator import Communicator
from quire.models.context import ForwardContext
from quire.models.layers import RMSNorm, get_rope
from quire.models.llama import (
    _FUSED_SHARDS,
    LlamaDecoderLayer,
    Qwen2ForCausalLM,
    _fused_fragment,
    _fused_target,
    head_dim_of,
    load_tensors,
)
from quire.models.loader import iter_weights

#: Where a MiMo checkpoint keeps its MTP layers.
MTP_PREFIX = "model.mtp_layers."
#: An MTP layer's own modules; the rest of its tensors are its decoder layer's.
_OWN = ("token_layernorm.", "hidden_layernorm.", "input_proj.", "final_layernorm.")


class MiMoForCausalLM(Qwen2ForCausalLM):
    """The MiMo target: Qwen2, its checkpoint's MTP layers left unread (the head's)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights((name, tensor) for name, tensor in weights
                                    if not name.startswith(MTP_PREFIX))


def num_mtp_layers(config: PretrainedConfig) -> int:
    """The MTP layers a checkpoint's config declares (``num_nextn_predict_layers``)."""
    return int(getattr(config, "num_nextn_predict_layers", 0) or 0)


class MiMoMTPLayer(nn.Module):
    """One MTP layer (module docstring); its attention writes KV cache ``index``."""

    def __init__(self, config: PretrainedConfig, index: int, comm: Communicator,
                 num_layers: int) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        variant = replace(Qwen2ForCausalLM.decoder_variant(config),
                          sliding_windows=(None,) * num_layers)
        self.token_layernorm = RMSNorm(hidden, eps=eps)
        self.hidden_layernorm = RMSNorm(hidden, eps=eps)
        self.input_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.mtp_block = LlamaDecoderLayer(config, index, variant, comm)
        self.final_layernorm = RMSNorm(hidden, eps=eps)

    def forward(self, embeds: torch.Tensor, features: torch.Tensor,
                rotary: tuple[torch.Tensor, torch.Tensor], ctx: ForwardContext
                ) -> torch.Tensor:
        """[T, H] embeddings and hidden states -> [T, H], after the final norm."""
        joined = torch.cat((self.hidden_layernorm(features, ops=ctx.ops),
                            self.token_layernorm(embeds, ops=ctx.ops)), dim=-1)
        hidden, residual = self.mtp_block(self.input_proj(joined), None, rotary, ctx)
        return self.final_layernorm(hidden + residual, ops=ctx.ops)


class MiMoMTPHead(nn.Module):
    """The checkpoint's MTP layers as a draft head; :meth:`share` gives it the target's
    embedding and LM head. KV-cache attributes as a model's: :attr:`num_layers` (one
    cache per MTP layer), :attr:`num_kv_heads` (on this rank), :attr:`head_dim`."""

    def __init__(self, config: PretrainedConfig, comm: Communicator, num_layers: int) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(MiMoMTPLayer(config, i, comm, num_layers)
                                    for i in range(num_layers))
        self.rotary_emb = get_rope(config, head_dim_of(config))
        attn = self.layers[0].mtp_block.self_attn
        self.num_layers: int = num_layers
        self.num_kv_heads: int = attn.num_kv_heads
        self.head_dim: int = attn.head_dim
        # the target's modules, in a tuple so that they are not this module's submodules
        self._shared: tuple[nn.Module, ...] = ()

    def share(self, target: nn.Module) -> None:
        """Use ``target``'s embedding and LM head."""
        self._shared = (target.model.embed_tokens, target)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext, features: torch.Tensor, step: int = 0) -> torch.Tensor:
        """:param input_ids: int64 [T], token ``i + 1`` at row ``i``.
        :param positions: int64 [T], ``i`` (where the K/V goes).
        :param features: [T, H], the target's final hidden state at ``i``, or the head's
            own output there, drafting further.
        :param step: the draft step, 0 over the target's hidden states. Step ``j``
            answers with layer ``min(j, num_layers - 1)``'s output, and runs every
            later layer too on the same input, only to write its K/V there: a layer
            answering a later step then attends over K/V at every position before its
            own (step 0 writes all the known positions, from the target's states).
        :returns: [T, H], after the answering layer's final norm.
        """
        assert self._shared, "share() the target's embedding first"
        embeds = self._shared[0](input_ids)
        embeds = embeds.masked_fill((positions == 0).unsqueeze(-1), 0)
        features = features.to(embeds.dtype)
        rotary = self.rotary_emb(positions, embeds.dtype)
        first = min(step, self.num_layers - 1)
        outs = [layer(embeds, features, rotary, ctx) for layer in self.layers[first:]]
        return outs[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's LM head over the head's hidden states: float32 [N, vocab]."""
        assert self._shared, "share() the target's LM head first"
        return self._shared[1].compute_logits(hidden)

    def propose(self, hidden: torch.Tensor) -> torch.Tensor:
        """The argmax token of each row of the head's hidden states."""
        return self.compute_logits(hidden).argmax(dim=-1)

    def target_features(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the head reads of a target forward: its final hidden states."""
        return hidden

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy the checkpoint's ``model.mtp_layers.*`` tensors in (this rank's shards),
        skipping every other; returns the names of the parameters now loaded.
        :raises ValueError: naming a tensor that fits no parameter."""
        named = ((name, tensor) for name, tensor in
                 ((head_name(n), t) for n, t in weights) if name is not None)
        return load_tensors(self, named, _fused_target,
                            lambda target: _FUSED_SHARDS[_fused_fragment(target)])


def head_name(name: str) -> str | None:
    """A checkpoint tensor's name in :class:`MiMoMTPHead`, or None for one of the
    target's (``model.mtp_layers.0.input_proj.weight`` -> ``layers.0.input_proj.weight``,
    ``model.mtp_layers.0.self_attn.q_proj.weight`` ->
    ``layers.0.mtp_block.self_attn.q_proj.weight``)."""
    if not name.startswith(MTP_PREFIX) or name.endswith("rotary_emb.inv_freq"):
        return None
    index, _, rest = name.removeprefix(MTP_PREFIX).partition(".")
    return f"layers.{index}.{rest}" if rest.startswith(_OWN) \
        else f"layers.{index}.mtp_block.{rest}"


def load_mtp_head(path: str, comm: Communicator, device: torch.device | str,
                  dtype: torch.dtype, target: nn.Module) -> MiMoMTPHead:
    """Build the MTP head from the target checkpoint at ``path`` (whose embedding and LM
    head it shares) and load its layers.

    :raises ValueError: naming ``speculative_config.method``, for a target without MTP
        layers (a family other than MiMo, or ``num_nextn_predict_layers`` 0), or a
        checkpoint that misses one of their tensors or holds a stray one.
    """
    arch = (getattr(target.config, "architectures", None) or [type(target).__name__])[0]
    count = num_mtp_layers(target.config)
    if not isinstance(target, MiMoForCausalLM) or count < 1:
        raise ValueError(f"speculative_config.method 'mtp' needs a checkpoint with its own "
                         f"MTP layers (MiMoForCausalLM, num_nextn_predict_layers >= 1); "
                         f"{path!r} is {arch} with {count}")
    head = MiMoMTPHead(target.config, comm, count)
    head.to(device=device, dtype=dtype)
    try:
        loaded = head.load_weights(iter_weights(path))
    except ValueError as exc:
        raise ValueError(f"speculative_config.method 'mtp': {path!r}: {exc}") from None
    missing = [n for n, _ in head.named_parameters() if n not in loaded]
    if missing:
        raise ValueError(f"speculative_config.method 'mtp': {path!r} declares {count} MTP "
                         f"layers but does not provide {', '.join(missing[:8])}")
    head.share(target)
    return head.eval()
