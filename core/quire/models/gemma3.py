"""Gemma 3 (text): ``Gemma3ForCausalLM``, config ``model_type`` ``gemma3_text``.

Where it differs from the Llama decoder (:mod:`quire.models.llama`):

- *Two kinds of layer*, named by ``config.layer_types``: ``sliding_attention`` (a window
  of ``sliding_window`` tokens) and ``full_attention``; each kind has its own rotary
  table (transformers v5 keeps one rope dict per kind in ``config.rope_parameters``;
  older configs name the local base ``rope_local_base_freq``).
- *Norms*: ``(1 + weight)`` RMSNorms (``offset=1.0``), four per layer: before and after
  attention (``input_layernorm``, ``post_attention_layernorm``), before and after the MLP
  (``pre_feedforward_layernorm``, ``post_feedforward_layernorm``); q/k norm per head.
- *MLP*: GELU (tanh approximation) gate times up, through ``ctx.ops.gelu_tanh_and_mul``.
- *Scales*: embeddings times ``sqrt(hidden_size)`` (a float32 constant cast to the
  model dtype, as HF does), attention scale ``query_pre_attn_scalar ** -0.5``, optional
  ``final_logit_softcapping`` on the logits and ``attn_logit_softcapping`` on the
  attention scores (transformers' Gemma 3 leaves the latter unused; released Gemma 3
  configs set it to null; Gemma 2 applied it).
- Tied embeddings by default.

The residual stream is carried as in Llama, the add folded into the next norm: a layer
returns (its post-feed-forward-normed MLP output, the residual before adding it), which
is also what a pipeline stage hands to the next. Weight loading (fused QKV and gate/up,
tied head, pipeline stage names) is Llama's.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from quire.interfaces.communicator import Communicator
from quire.models.compile import never_traced
from quire.models.context import ForwardContext
from quire.models.layers import (
    GatedMLP,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    apply_rotary,
    get_rope,
)
from quire.models.llama import LlamaForCausalLM, head_dim_of, num_kv_heads_of
from quire.models.pipeline import LayerGap, PipelineStage
from quire.ops.layer_spec import (
    DecoderLayerKernel,
    DecoderLayerSpec,
    DecoderStackKernel,
    norm_spec,
)

SLIDING, FULL = "sliding_attention", "full_attention"
#: Gemma's ``(1 + weight)`` norms.
NORM_OFFSET = 1.0
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")


def gemma3_layer_types(config: PretrainedConfig) -> tuple[str, ...]:
    """Each layer's kind: ``config.layer_types``, else every ``sliding_window_pattern``-th
    layer full (HF's default pattern, 6).

    :raises ValueError: for a kind other than sliding or full, or a wrong count.
    """
    types = getattr(config, "layer_types", None)
    n = config.num_hidden_layers
    if not types:
        pattern = (getattr(config, "sliding_window_pattern", None)
                   or getattr(config, "_sliding_window_pattern", None) or 6)
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
    unknown = sorted(set(types) - {SLIDING, FULL})
    if unknown or len(types) != n:
        raise ValueError(f"Gemma 3 layer_types must be {n} entries of {SLIDING!r} or "
                         f"{FULL!r}; got {list(types)}")
    return tuple(types)


def gemma3_rope_parameters(config: PretrainedConfig) -> dict[str, dict[str, Any]]:
    """Rope settings per layer kind: ``config.rope_parameters[kind]`` (transformers v5),
    else ``rope_theta`` + ``rope_scaling`` for full layers and ``rope_local_base_freq``
    (default rope) for sliding ones."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and isinstance(params.get(FULL), dict):
        return {kind: dict(params.get(kind) or {"rope_type": "default"})
                for kind in (SLIDING, FULL)}
    full = dict(getattr(config, "rope_scaling", None) or {})
    full.setdefault("rope_theta", getattr(config, "rope_theta", None) or 1_000_000.0)
    local = getattr(config, "rope_local_base_freq", None) or 10_000.0
    return {SLIDING: {"rope_type": "default", "rope_theta": local}, FULL: full}


def _rope_table(config: PretrainedConfig, params: dict[str, Any]) -> RotaryEmbedding:
    # get_rope reads one flat rope dict; a view of the config with this kind's dict
    view = SimpleNamespace(
        rope_parameters=params,
        max_position_embeddings=config.max_position_embeddings,
        original_max_position_embeddings=getattr(
            config, "original_max_position_embeddings", None),
    )
    return get_rope(view, head_dim_of(config))


class Gemma3Attention(nn.Module):
    """Fused QKV, per-head ``(1 + w)`` q/k norm, rotary of this layer's kind, paged
    attention (windowed on sliding layers), output projection."""

    def __init__(self, config: PretrainedConfig, layer_idx: int, layer_type: str,
                 comm: Communicator) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.layer_type = layer_type
        self.head_dim = head_dim_of(config)
        self.scale = float(config.query_pre_attn_scalar) ** -0.5
        self.sliding_window: int | None = (
            config.sliding_window if layer_type == SLIDING else None)
        self.logits_soft_cap: float | None = getattr(config, "attn_logit_softcapping", None)
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, config.num_attention_heads,
            num_kv_heads_of(config), bias=bias, comm=comm,
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias=bias,
            comm=comm,
        )
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps, offset=NORM_OFFSET)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps, offset=NORM_OFFSET)

    def forward(self, hidden: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
                ctx: ForwardContext) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]; ``rotary`` is this step's (cos, sin) of this
        layer's kind."""
        t = hidden.shape[0]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = self.qkv_proj(hidden).split([hq * d, hkv * d, hkv * d], dim=-1)
        qk = torch.cat((self.q_norm(q.view(t, hq, d), ops=ctx.ops),
                        self.k_norm(k.view(t, hkv, d), ops=ctx.ops)), dim=1)
        cos, sin = rotary
        if ctx.kv_slots is not None:  # the platform's op rotates and writes K/V at once
            out = self._rotate_and_attend(qk, v.view(t, hkv, d), cos, sin, ctx)
        else:
            q, k = apply_rotary(qk, cos, sin).split([hq, hkv], dim=1)
            out = self._attend(q, k, v.view(t, hkv, d), ctx)
        return self.o_proj(out.reshape(t, hq * d))

    # Not traced by torch.compile, as LlamaAttention._attend (per-step Python metadata).
    @never_traced
    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        return ctx.attention(self.layer_idx, q, k, v, scale=self.scale,
                             sliding_window=self.sliding_window,
                             logits_soft_cap=self.logits_soft_cap)

    @never_traced
    def _rotate_and_attend(self, qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                           sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return ctx.rotary_attention(self.layer_idx, qk, v, cos, sin, scale=self.scale,
                                    sliding_window=self.sliding_window,
                                    logits_soft_cap=self.logits_soft_cap)


class Gemma3MLP(GatedMLP):
    """``down(gelu_tanh(gate(x)) * up(x))``, gate and up in one matmul."""

    def __init__(self, config: PretrainedConfig, comm: Communicator) -> None:
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
        if act not in _GELU_TANH:
            raise ValueError(f"unsupported Gemma 3 hidden_activation {act!r}; supported: "
                             f"{', '.join(_GELU_TANH)}")
        super().__init__(config.hidden_size, config.intermediate_size, "gelu_tanh",
                         bias=False, comm=comm)


class Gemma3DecoderLayer(nn.Module):
    """Norms before and after each of attention and MLP; the residual add in the next
    pre-norm (the same single add as HF's ``residual + hidden``)."""

    def __init__(self, config: PretrainedConfig, layer_idx: int, layer_type: str,
                 comm: Communicator) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.self_attn = Gemma3Attention(config, layer_idx, layer_type, comm)
        self.mlp = Gemma3MLP(config, comm)
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps=eps, offset=NORM_OFFSET)
        self.post_attention_layernorm = RMSNorm(h, eps=eps, offset=NORM_OFFSET)
        self.pre_feedforward_layernorm = RMSNorm(h, eps=eps, offset=NORM_OFFSET)
        self.post_feedforward_layernorm = RMSNorm(h, eps=eps, offset=NORM_OFFSET)
        self.kernel: DecoderLayerKernel | None = None

    def fusion_spec(self) -> DecoderLayerSpec:
        """This layer as data, for a platform that runs whole layers (``layer.kernel``)."""
        attn = self.self_attn
        return DecoderLayerSpec(
            layer_idx=attn.layer_idx, num_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim, scale=attn.scale,
            sliding_window=attn.sliding_window, logits_soft_cap=attn.logits_soft_cap,
            input_norm=norm_spec(self.input_layernorm), q_norm=norm_spec(attn.q_norm),
            k_norm=norm_spec(attn.k_norm),
            attn_out_norm=norm_spec(self.post_attention_layernorm),
            pre_mlp_norm=norm_spec(self.pre_feedforward_layernorm),
            mlp_out_norm=norm_spec(self.post_feedforward_layernorm),
            activation=self.mlp.activation,
            qkv=attn.qkv_proj, o=attn.o_proj, gate_up=self.mlp.gate_up_proj,
            down=self.mlp.down_proj, world_size=attn.o_proj.comm.world_size)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                rotary: tuple[torch.Tensor, torch.Tensor], ctx: ForwardContext,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """:returns: (this layer's normed MLP output, the residual stream before adding
        it)."""
        if self.kernel is not None:
            done = self.kernel(hidden, residual, rotary, ctx)
            if done is not None:
                return done
        if residual is None:  # first layer: the stream is the scaled embeddings
            residual = hidden
            hidden = self.input_layernorm(hidden, ops=ctx.ops)
        else:
            hidden, residual = self.input_layernorm(hidden, residual, ctx.ops)
        hidden = self.post_attention_layernorm(self.self_attn(hidden, rotary, ctx),
                                               ops=ctx.ops)
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual, ctx.ops)
        hidden = self.post_feedforward_layernorm(self.mlp(hidden, ctx), ops=ctx.ops)
        return hidden, residual


class Gemma3Model(nn.Module):
    """Scaled embedding, decoder layers, final norm (HF's ``model.`` prefix); with a
    pipeline ``stage``, only that stage's part."""

    def __init__(self, config: PretrainedConfig, comm: Communicator,
                 stage: PipelineStage | None = None) -> None:
        super().__init__()
        self.stage = stage
        self.layer_types = gemma3_layer_types(config)
        first, last = stage is None or stage.is_first, stage is None or stage.is_last
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                    comm=comm) if first else None)
        # float32 like HF's buffer; the engine's .to(dtype) rounds it as HF's does
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size**0.5),
                             persistent=False)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, i, kind, comm)
            if stage is None or stage.holds(i) else LayerGap()
            for i, kind in enumerate(self.layer_types)
        )
        self.norm = (RMSNorm(config.hidden_size, eps=config.rms_norm_eps, offset=NORM_OFFSET)
                     if last else None)
        # One table per layer kind; each step's cos/sin looked up once per kind.
        rope = gemma3_rope_parameters(config)
        self.rotary_emb = nn.ModuleDict(
            {kind: _rope_table(config, rope[kind]) for kind in sorted(set(self.layer_types))})
        #: A platform's forward for consecutive layers (quire/ops/layer_spec.py), or None.
        self.layers_kernel: DecoderStackKernel | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`quire.models.llama.LlamaModel.forward`."""
        residual: torch.Tensor | None
        if intermediate is None:
            if self.embed_tokens is None:
                raise ValueError("a pipeline stage after the first needs `intermediate`")
            hidden = self.embed_tokens(input_ids)
            # image embeddings go in after the scale, as transformers places them
            hidden = ctx.merge_mm(hidden * self.embed_scale.to(hidden.dtype))
            residual = None
        else:
            hidden, residual = intermediate
        rotary = {kind: table(positions, hidden.dtype)
                  for kind, table in self.rotary_emb.items()}
        start, end = ((0, len(self.layers)) if self.stage is None
                      else (self.stage.start, self.stage.end))
        done = None
        if self.layers_kernel is not None:
            done = self.layers_kernel(start, end, hidden, residual,
                                      [rotary[kind] for kind in self.layer_types[start:end]],
                                      ctx)
        if done is not None:
            hidden, residual = done
        else:
            for layer in self.layers[start:end]:
                hidden, residual = layer(hidden, residual, rotary[layer.layer_type], ctx)
        if self.norm is None:
            assert residual is not None
            return hidden, residual
        hidden, _ = self.norm(hidden, residual, ctx.ops)
        return hidden


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3 text model over a flattened batch; see the module docs.

    :param config: a ``Gemma3TextConfig`` (from a checkpoint or built from GGUF).
    :param comm: the tensor-parallel group.
    :param stage: the pipeline stage this rank holds, or None for all layers.

    Shares Llama's weight loading (:meth:`LlamaForCausalLM.load_weights`), pipeline
    naming and the KV-cache attributes (:attr:`num_layers`, :attr:`num_kv_heads`,
    :attr:`head_dim`; every layer has the same KV shape).
    """

    supports_pipeline = True

    def __init__(self, config: PretrainedConfig, comm: Communicator,
                 stage: PipelineStage | None = None) -> None:
        nn.Module.__init__(self)  # Llama's __init__ builds a Llama model
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("Gemma 3 with use_bidirectional_attention (an encoder) is not "
                             "supported: quire runs causal models")
        self.config = config
        self.stage = stage
        self.model = Gemma3Model(config, comm, stage)
        self.kv_layer_ids: tuple[int, ...] = (
            tuple(range(config.num_hidden_layers)) if stage is None
            else tuple(range(stage.start, stage.end)))
        attn = self.model.layers[self.kv_layer_ids[0]].self_attn
        self.num_layers: int = config.num_hidden_layers
        self.num_kv_heads: int = attn.num_kv_heads
        self.head_dim: int = attn.head_dim
        #: Per layer: its attention window in tokens, or None (full attention).
        self.sliding_windows: tuple[int | None, ...] = tuple(
            config.sliding_window if kind == SLIDING else None
            for kind in self.model.layer_types)
        self.final_logit_softcap: float | None = getattr(
            config, "final_logit_softcapping", None)
        last = stage is None or stage.is_last
        self.lm_head = (ParallelLMHead(config.vocab_size, config.hidden_size, comm=comm)
                        if last else None)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        if self.tie_word_embeddings and self.lm_head is not None \
                and self.model.embed_tokens is not None:
            self.lm_head.tie_to(self.model.embed_tokens)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden_size] -> [N, vocab_size] float32 logits, soft-capped
        (``cap * tanh(logits / cap)``) when the config sets ``final_logit_softcapping``."""
        logits = super().compute_logits(hidden)
        cap = self.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
