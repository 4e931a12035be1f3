"""The Llama-family decoder: Llama 2/3 (and SmolLM2), Mistral, Qwen2, Qwen3.

One implementation; the families differ in a few switches, gathered in
:class:`DecoderVariant` and read from the Hugging Face config:

- Llama (also SmolLM2): ``attention_bias`` on q/k/v and o_proj; full attention (as in
  HF, a stray ``sliding_window`` in a Llama config is ignored).
- Mistral: as Llama (its configs have no biases), plus ``sliding_window`` (when set) on
  every layer.
- Qwen2: bias on q/k/v only; when ``use_sliding_window``, a window on the layers from
  ``max_window_layers`` on (or those ``layer_types`` marks).
- Qwen3: ``attention_bias`` on q/k/v and o_proj; per-head RMSNorm of q and k before
  the rotary embedding; windows as Qwen2.

The MLP bias is ``mlp_bias`` (Llama only; false elsewhere).

The model runs on a *flattened* batch: ``forward(input_ids [T], positions [T], ctx)``,
with every sequence's new tokens concatenated; attention goes through
``ctx.attention`` (the platform's paged backend). Module and parameter names mirror
Hugging Face's (``model.layers.N.self_attn...``) except for the two fusions, whose
loaders take the checkpoint's separate tensors: ``qkv_proj`` (``q_proj``, ``k_proj``,
``v_proj``) and ``gate_up_proj`` (``gate_proj``, ``up_proj``).

Tensor parallelism: every layer takes the communicator and holds its shard (heads per
rank = total heads / world size); at world size 1 no collective runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
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
    RowParallelLinear,
    VocabParallelEmbedding,
    apply_rotary,
    default_weight_loader,
    get_rope,
)
from quire.models.pipeline import LayerGap, PipelineStage
from quire.ops.layer_spec import (
    DecoderLayerKernel,
    DecoderLayerSpec,
    DecoderStackKernel,
    norm_spec,
)

#: Checkpoint tensor name fragment -> (our fused parameter's fragment, shard id).
_FUSED: dict[str, tuple[str, Any]] = {
    ".q_proj.": (".qkv_proj.", "q"),
    ".k_proj.": (".qkv_proj.", "k"),
    ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}
#: Every shard a fused parameter needs before it counts as loaded.
_FUSED_SHARDS: dict[str, frozenset[Any]] = {
    ".qkv_proj.": frozenset("qkv"),
    ".gate_up_proj.": frozenset({0, 1}),
}
#: Checkpoint tensors with no parameter here: buffers some older checkpoints saved.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


@dataclass(frozen=True)
class DecoderVariant:
    """What distinguishes one family's decoder layer from another's."""

    qkv_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    #: RMSNorm over each head's query/key (Qwen3), before the rotary embedding.
    qk_norm: bool
    #: One entry per layer: its attention window in tokens, or None for full attention.
    sliding_windows: tuple[int | None, ...]


def head_dim_of(config: PretrainedConfig) -> int:
    """``config.head_dim`` when set, else ``hidden_size / num_attention_heads``."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def num_kv_heads_of(config: PretrainedConfig) -> int:
    """``config.num_key_value_heads``; configs from before GQA lack it (one per query head)."""
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def _mistral_windows(config: PretrainedConfig) -> tuple[int | None, ...]:
    # The same window on every layer (None: full attention, as Mistral v0.2 and later).
    window = getattr(config, "sliding_window", None)
    return (window,) * config.num_hidden_layers


def _qwen_windows(config: PretrainedConfig) -> tuple[int | None, ...]:
    # Qwen2/3 window only when use_sliding_window is on, and then only the layers from
    # max_window_layers on (or those config.layer_types marks, where a config has them).
    # Older configs keep sliding_window set even when it is off, hence the flag check.
    window = getattr(config, "sliding_window", None)
    n = config.num_hidden_layers
    if not getattr(config, "use_sliding_window", False) or window is None:
        return (None,) * n
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    first = getattr(config, "max_window_layers", 0)
    return tuple(window if i >= first else None for i in range(n))


class LlamaAttention(nn.Module):
    """Fused QKV projection, (q/k norm), rotary, paged attention, output projection."""

    def __init__(
        self,
        config: PretrainedConfig,
        layer_idx: int,
        variant: DecoderVariant,
        comm: Communicator,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = head_dim_of(config)
        self.scale = self.head_dim**-0.5
        self.sliding_window = variant.sliding_windows[layer_idx]
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            config.num_attention_heads,
            num_kv_heads_of(config),
            bias=variant.qkv_bias,
            comm=comm,
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim,
            config.hidden_size,
            bias=variant.o_proj_bias,
            comm=comm,
        )
        if variant.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        ctx: ForwardContext,
    ) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]; ``rotary`` is this step's (cos, sin)."""
        t = hidden.shape[0]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(hidden)
        qk, v = qkv.split([(hq + hkv) * d, hkv * d], dim=-1)
        qk = qk.view(t, hq + hkv, d)
        v = v.view(t, hkv, d)
        if self.q_norm is not None:
            q, k = qk.split([hq, hkv], dim=1)
            qk = torch.cat((self.q_norm(q, ops=ctx.ops), self.k_norm(k, ops=ctx.ops)), dim=1)
        cos, sin = rotary
        if ctx.kv_slots is not None:  # the platform's op rotates and writes K/V at once
            out = self._rotate_and_attend(qk, v, cos, sin, ctx)
        else:
            # q and k heads side by side in one rotation: the same per-element arithmetic
            # as rotating each apart, in half the ops (what a decode step is made of)
            q, k = apply_rotary(qk, cos, sin).split([hq, hkv], dim=1)
            out = self._attend(q, k, v, ctx)
        return self.o_proj(out.reshape(t, hq * d))

    # Never traced by torch.compile (quire.models.compile): the backend's metadata is
    # per-step Python data, and reading layer_idx here rather than in the traced code
    # keeps one graph for every layer instead of one per layer index.
    @never_traced
    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        return ctx.attention(
            self.layer_idx, q, k, v, scale=self.scale, sliding_window=self.sliding_window
        )

    @never_traced
    def _rotate_and_attend(self, qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                           sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return ctx.rotary_attention(self.layer_idx, qk, v, cos, sin, scale=self.scale,
                                    sliding_window=self.sliding_window)


class LlamaMLP(GatedMLP):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one matmul."""

    def __init__(
        self, config: PretrainedConfig, variant: DecoderVariant, comm: Communicator
    ) -> None:
        act = getattr(config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {act!r}; supported: silu")
        super().__init__(config.hidden_size, config.intermediate_size, "silu",
                         bias=variant.mlp_bias, comm=comm)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP, each added to the residual stream.

    The residual add happens inside the next norm (:class:`RMSNorm` with ``residual``):
    the same single add Hugging Face does, so results are unchanged.
    """

    def __init__(
        self,
        config: PretrainedConfig,
        layer_idx: int,
        variant: DecoderVariant,
        comm: Communicator,
        mlp: nn.Module | None = None,
    ) -> None:
        """:param mlp: called as ``mlp(x, ctx)``; default the family's gated MLP (a
            mixture-of-experts block on an MoE model's sparse layers)."""
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, variant, comm)
        self.mlp = mlp if mlp is not None else LlamaMLP(config, variant, comm)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.kernel: DecoderLayerKernel | None = None

    def fusion_spec(self) -> DecoderLayerSpec:
        """This layer as data, for a platform that runs whole layers (``layer.kernel``):
        a gated MLP as its two linear sites, any other (MoE) as a callable."""
        attn, mlp = self.self_attn, self.mlp
        gated = isinstance(mlp, GatedMLP)
        return DecoderLayerSpec(
            layer_idx=attn.layer_idx, num_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim, scale=attn.scale,
            sliding_window=attn.sliding_window, logits_soft_cap=None,
            input_norm=norm_spec(self.input_layernorm),
            q_norm=None if attn.q_norm is None else norm_spec(attn.q_norm),
            k_norm=None if attn.k_norm is None else norm_spec(attn.k_norm),
            attn_out_norm=None, pre_mlp_norm=norm_spec(self.post_attention_layernorm),
            mlp_out_norm=None, activation=mlp.activation if gated else "silu",
            qkv=attn.qkv_proj, o=attn.o_proj, gate_up=mlp.gate_up_proj if gated else None,
            down=mlp.down_proj if gated else None, world_size=attn.o_proj.comm.world_size,
            mlp=None if gated else mlp)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: tuple[torch.Tensor, torch.Tensor],
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:returns: (this layer's MLP output, the residual stream before adding it)."""
        if self.kernel is not None:
            done = self.kernel(hidden, residual, rotary, ctx)
            if done is not None:
                return done
        if residual is None:  # first layer: the stream is the embeddings
            residual = hidden
            hidden = self.input_layernorm(hidden, ops=ctx.ops)
        else:
            hidden, residual = self.input_layernorm(hidden, residual, ctx.ops)
        hidden = self.self_attn(hidden, rotary, ctx)
        hidden, residual = self.post_attention_layernorm(hidden, residual, ctx.ops)
        return self.mlp(hidden, ctx), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers and the final norm (HF's ``model.`` prefix); with a
    pipeline ``stage``, only that stage's part (other layers are :class:`LayerGap`)."""

    def __init__(
        self, config: PretrainedConfig, variant: DecoderVariant, comm: Communicator,
        stage: PipelineStage | None = None,
        make_mlp: Callable[[int], nn.Module | None] | None = None,
    ) -> None:
        """:param make_mlp: layer index -> that layer's MLP, or None for the default."""
        super().__init__()
        self.stage = stage
        last = stage is None or stage.is_last
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                    comm=comm)
                             if stage is None or stage.embeds else None)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, variant, comm,
                              mlp=None if make_mlp is None else make_mlp(i))
            if stage is None or stage.holds(i) else LayerGap()
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps) if last else None
        # One table for every layer; each step's cos/sin are looked up once, not per layer.
        self.rotary_emb = get_rope(config, head_dim_of(config))
        #: Layers whose input hidden states (the residual stream) a forward keeps in
        #: :attr:`aux_hidden_states`, joined in this order (an EAGLE-3 head reads them);
        #: empty: none kept.
        self.aux_layers: tuple[int, ...] = ()
        self.aux_hidden_states: torch.Tensor | None = None
        #: A platform's forward for consecutive layers (quire/ops/layer_spec.py), or None.
        self.layers_kernel: DecoderStackKernel | None = None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
        intermediate: tuple[torch.Tensor, ...] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """The final hidden states, or on a stage before the last its (hidden, residual)
        for the next, and with :attr:`aux_layers` the kept inputs so far; a stage after
        the first starts from ``intermediate``, the previous stage's."""
        residual: torch.Tensor | None
        aux = None
        if intermediate is None:
            assert self.embed_tokens is not None
            hidden, residual = ctx.merge_mm(self.embed_tokens(input_ids)), None
        else:
            hidden, residual = intermediate[0], intermediate[1]
            aux = intermediate[2] if len(intermediate) > 2 else None
        rotary = self.rotary_emb(positions, hidden.dtype)
        start, end = ((0, len(self.layers)) if self.stage is None
                      else (self.stage.start, self.stage.end))
        if self.aux_layers:
            hidden, residual, aux = self._layers_keeping_aux(hidden, residual, rotary, ctx,
                                                             start, end, aux)
        else:
            done = (None if self.layers_kernel is None else
                    self.layers_kernel(start, end, hidden, residual, (rotary,) * (end - start),
                                       ctx))
            if done is not None:
                hidden, residual = done
            else:
                for layer in self.layers[start:end]:
                    hidden, residual = layer(hidden, residual, rotary, ctx)
        if self.norm is None:
            assert residual is not None
            return (hidden, residual) if aux is None else (hidden, residual, aux)
        self.aux_hidden_states = aux
        hidden, _ = self.norm(hidden, residual, ctx.ops)
        return hidden

    def _layers_keeping_aux(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                            rotary: tuple[torch.Tensor, torch.Tensor], ctx: ForwardContext,
                            start: int, end: int, aux: torch.Tensor | None
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layers ``start .. end - 1``, keeping the inputs of those among
        :attr:`aux_layers` in their slots of ``aux`` ([T, len(aux_layers) * H], the
        earlier stages' slots filled; made on the first stage)."""
        width = hidden.shape[-1]
        if aux is None:
            aux = hidden.new_empty(hidden.shape[0], len(self.aux_layers) * width)
        for i in range(start, end):
            for slot, layer_id in enumerate(self.aux_layers):
                if layer_id == i:
                    aux[:, slot * width : (slot + 1) * width] = (
                        hidden if residual is None else hidden + residual)
            hidden, residual = self.layers[i](hidden, residual, rotary, ctx)
        assert residual is not None
        return hidden, residual, aux


class LlamaForCausalLM(nn.Module):
    """A causal LM of the Llama family over a flattened batch.

    :param config: the Hugging Face config (``LlamaConfig`` or a sibling).
    :param comm: the tensor-parallel group; world size 1 for a single device.

    Parameters are uninitialised (``torch.empty``) until :meth:`load_weights`; the engine
    moves the model with ``.to(device=..., dtype=...)`` first.

    For sizing KV caches (one per layer, indexed by layer number in the
    ``ForwardContext``): :attr:`num_layers`, :attr:`num_kv_heads` (on this rank) and
    :attr:`head_dim`.
    """

    #: It can be split into pipeline stages (``stage=``).
    supports_pipeline = True

    def __init__(self, config: PretrainedConfig, comm: Communicator,
                 stage: PipelineStage | None = None) -> None:
        super().__init__()
        self.config = config
        self.variant = self.decoder_variant(config)
        if len(self.variant.sliding_windows) != config.num_hidden_layers:
            raise ValueError(
                f"{type(self).__name__}: {len(self.variant.sliding_windows)} per-layer "
                f"window entries for {config.num_hidden_layers} layers"
            )
        self.stage = stage
        self.model = LlamaModel(config, self.variant, comm, stage,
                                lambda i: self.make_mlp(config, i, comm))
        #: Global indices of the layers (and KV caches) this rank holds.
        self.kv_layer_ids: tuple[int, ...] = (
            tuple(range(config.num_hidden_layers)) if stage is None
            else tuple(range(stage.start, stage.end)))
        attn = self.model.layers[self.kv_layer_ids[0]].self_attn
        self.num_layers: int = config.num_hidden_layers
        self.num_kv_heads: int = attn.num_kv_heads
        self.head_dim: int = attn.head_dim
        last = stage is None or stage.is_last
        self.lm_head = (ParallelLMHead(config.vocab_size, config.hidden_size, comm=comm)
                        if last else None)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings and self.lm_head is not None \
                and self.model.embed_tokens is not None:
            self.lm_head.tie_to(self.model.embed_tokens)

    def make_mlp(self, config: PretrainedConfig, layer_idx: int,
                 comm: Communicator) -> nn.Module | None:
        """Layer ``layer_idx``'s MLP when the family's is not the gated MLP (MoE models
        override this); None: the gated MLP."""
        return None

    @classmethod
    def decoder_variant(cls, config: PretrainedConfig) -> DecoderVariant:
        """The family's switches, read from ``config``."""
        bias = bool(getattr(config, "attention_bias", False))
        return DecoderVariant(
            qkv_bias=bias,
            o_proj_bias=bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=False,
            sliding_windows=(None,) * config.num_hidden_layers,
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
        intermediate: tuple[torch.Tensor, ...] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """:param input_ids: int64 [T]. :param positions: int64 [T].
        :param intermediate: a later pipeline stage's input: the previous stage's
            (hidden, residual), each [T, hidden_size], and with an EAGLE-3 head's
            layers kept (``model.aux_layers``) their inputs so far.

        :returns: [T, hidden_size], after the final norm; on a pipeline stage before the
            last, (hidden, residual[, kept inputs]) for the next stage.
        """
        return self.model(input_ids, positions, ctx, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden_size] -> [N, vocab_size] float32 logits (every rank gets all)."""
        assert self.lm_head is not None, "only the last pipeline stage has the LM head"
        return self.lm_head(hidden).float()

    def _stage_name(self, name: str) -> str | None:
        """``name`` as this pipeline stage loads it, or None when another stage does: a
        last stage whose LM head is tied to an embedding it lacks loads it from the
        embedding's tensor."""
        stage = self.stage
        if stage is None:
            return name
        layer = _layer_of(name)
        if layer is not None:
            return name if stage.holds(layer) else None
        if name.startswith("model.embed_tokens."):
            if stage.embeds:
                return name
            tied_here = self.tie_word_embeddings and stage.is_last
            return name.replace("model.embed_tokens.", "lm_head.") if tied_here else None
        if name.startswith(("model.norm.", "lm_head.")):
            return name if stage.is_last else None
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy Hugging Face-named tensors into the parameters (this rank's shards).

        :param weights: (name, full tensor) pairs, any dtype, any order.
        :returns: names (as in ``named_parameters()``) of the parameters now completely
            loaded; a fused parameter counts once all its parts arrived. Checking that
            nothing is missing is the caller's job (see ``quire.models.loader``).
        :raises ValueError: naming a tensor that has no parameter here, or whose shape
            does not fit its parameter.
        """
        def ours() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                if self.tie_word_embeddings and name == "lm_head.weight":
                    continue  # the embedding's weight, already loaded under its own name
                name = self._stage_name(self.checkpoint_name(name))
                if name is not None:  # else another pipeline stage's
                    yield name, tensor

        return load_tensors(self, ours(), self.parameter_of, self.shards_needed)

    def checkpoint_name(self, name: str) -> str:
        """A checkpoint's tensor name in this model's module layout (Mixtral's
        ``block_sparse_moe`` is ``mlp`` here). Default: unchanged."""
        return name

    def parameter_of(self, name: str) -> tuple[str, Any]:
        """(our parameter's name, shard id or None) for a checkpoint tensor name."""
        return _fused_target(name)

    def shards_needed(self, target: str) -> frozenset[Any]:
        """Every shard id a fused parameter needs before it counts as loaded."""
        return _FUSED_SHARDS[_fused_fragment(target)]


def load_tensors(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                 parameter_of: Callable[[str], tuple[str, Any]],
                 shards_needed: Callable[[str], frozenset[Any]]) -> set[str]:
    """Copy ``(name, full tensor)`` pairs, named as ``module`` names them, into its
    parameters through their loaders (this rank's shards).

    :param parameter_of: a name -> (the parameter's name, shard id or None).
    :param shards_needed: a fused parameter's name -> every shard id it needs.
    :returns: the parameters now completely loaded.
    :raises ValueError: naming a tensor that has no parameter, or does not fit it.
    """
    params = dict(module.named_parameters())
    shards: dict[str, set[Any]] = {}
    loaded: set[str] = set()
    for name, tensor in weights:
        target, shard_id = parameter_of(name)
        param = params.get(target)
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} has no parameter in "
                             f"{type(module).__name__}")
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
        if got >= shards_needed(target):
            loaded.add(target)
    return loaded


def _layer_of(name: str) -> int | None:
    """The decoder layer a checkpoint name belongs to (``model.layers.7.…`` -> 7)."""
    if not name.startswith("model.layers."):
        return None
    return int(name.split(".", 3)[2])


def _fused_target(name: str) -> tuple[str, Any]:
    for fragment, (fused, shard_id) in _FUSED.items():
        if fragment in name:
            return name.replace(fragment, fused), shard_id
    return name, None


def _fused_fragment(target: str) -> str:
    return next(f for f in _FUSED_SHARDS if f in target)


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: the Llama decoder with ``config.sliding_window`` on every layer."""

    @classmethod
    def decoder_variant(cls, config: PretrainedConfig) -> DecoderVariant:
        return replace(super().decoder_variant(config), sliding_windows=_mistral_windows(config))


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 / Qwen2.5: biased q/k/v, unbiased o_proj, optional windowed upper layers."""

    @classmethod
    def decoder_variant(cls, config: PretrainedConfig) -> DecoderVariant:
        return DecoderVariant(
            qkv_bias=True,
            o_proj_bias=False,
            mlp_bias=False,
            qk_norm=False,
            sliding_windows=_qwen_windows(config),
        )


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 (dense): per-head RMSNorm on q and k before rotary; ``attention_bias``."""

    @classmethod
    def decoder_variant(cls, config: PretrainedConfig) -> DecoderVariant:
        bias = bool(getattr(config, "attention_bias", False))
        return DecoderVariant(
            qkv_bias=bias,
            o_proj_bias=bias,
            mlp_bias=False,
            qk_norm=True,
            sliding_windows=_qwen_windows(config),
        )
