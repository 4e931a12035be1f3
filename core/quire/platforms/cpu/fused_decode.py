"""A Llama-family decoder layer in C for every step, attention included for decode steps.

A decode step's layer, run op by op, is ~20 torch operators and C calls. For a lone
sequence (``quire bench latency``, a chat on a laptop) on SmolLM2-135M their dispatch
was about half of each layer's time once the weights streamed from their compact
encoding; for a batch of 64 (W1) the small operators (KV writes by ``index_copy``,
SiLU and products, the rotary's roll) and the Python around them took ~40 ms of a
~200 ms step, and in a 2048-token prompt step ~0.3 s of ~3 s.
:class:`FusedDecodeLayer` hands the layer to ``csrc/decode_layer.c``:

- *pure decode steps* (every row the one new token of its own sequence): the whole
  layer in one call, norm, QKV, rotary, KV write, paged attention, output projection,
  norm and gated MLP. A lone sequence on compact weights runs
  ``quire_decode_layer_f32`` (weights streamed from their encoding, one row); other
  decode steps run ``quire_decode_batch_f32`` on the float32 panels.
- *any other step* (prompts, chunks after a cached prefix, mixed steps), on panels:
  the layer before attention (``quire_layer_front_f32``: residual, norm, QKV, rotary)
  and after it (``quire_layer_back_f32``: output projection, residual, norm, gated MLP)
  in C, and the attention backend in between, which writes the cache and attends as
  it does for the op-by-op path. A 2048-token prompt step of SmolLM2 went from 3.16 s
  to 2.97 s (alternating the two in one process).

A layer qualifies when it is :class:`~quire.models.llama.LlamaDecoderLayer` without
q/k norms, on one device (no all-reduce), with plain :class:`RMSNorm` s, and its four
linears are :class:`~quire.platforms.cpu.packed_linear.PackedLinear` s that either all
have a compact encoding (:mod:`~quire.platforms.cpu.compact`: GGUF Q4_0/Q4_1/Q8_0
weights and bf16 checkpoints) or all keep float32 panels (the native panel kernel,
AVX2 hosts). The whole-layer decode call also needs :class:`CpuSdpaAttentionBackend`'s
metadata and a float32 contiguous KV cache. What does not fit returns None and the
layer runs as written. Results agree with that path to float32 rounding (the same
kernels for products, norms and attention; the SiLU and rotary in C instead of torch).
"""

from __future__ import annotations

import ctypes
import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

from quire.models.context import ForwardContext
from quire.models.layers.norm import RMSNorm
from quire.platforms.cpu.native import LinearArgs, NativeKernels, PanelArgs
from quire.platforms.cpu.packed_linear import PackedLinear
from quire.platforms.cpu.sdpa_attention import CpuSdpaMetadata

if TYPE_CHECKING:
    from quire.models.llama import LlamaDecoderLayer

logger = logging.getLogger(__name__)


class FusedDecodeLayer:
    """One layer's :class:`~quire.models.llama.DecoderLayerKernel`: the whole layer in C
    for decode steps, its halves in C around the attention backend for the rest."""

    def __init__(self, native: NativeKernels, layer: LlamaDecoderLayer) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.native = native
        self.layer_idx = attn.layer_idx
        self.hq, self.hkv, self.d = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.scale = float(attn.scale)
        self.window = attn.sliding_window or 0
        self.hidden = layer.input_layernorm.weight.shape[0]
        self.norm_in = layer.input_layernorm.weight.detach()
        self.norm_post = layer.post_attention_layernorm.weight.detach()
        self.eps = float(layer.input_layernorm.eps)  # both norms' (_qualifies checks)
        modules = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        kernels = [module.kernel for module in modules]
        # ctypes structs pointing into the PackedLinears' tensors and the biases, which
        # live as long as the model; byref()s made once, not per call
        self._compact = None
        if all(k.compact is not None for k in kernels):
            self._compact_args = [LinearArgs.of(k.compact, _bias(m))
                                  for k, m in zip(kernels, modules)]
            self._compact = [ctypes.byref(args) for args in self._compact_args]
        self._panels = None
        if all(k.panels is not None for k in kernels):
            self._panel_args = [PanelArgs.of(k.panels, k.out_features, _bias(m))
                                for k, m in zip(kernels, modules)]
            self._panels = [ctypes.byref(args) for args in self._panel_args]

    def __call__(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: tuple[torch.Tensor, torch.Tensor],
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        rows = hidden.shape[0]
        cos, sin = rotary
        if not (rows > 0 and hidden.dtype == cos.dtype == sin.dtype == torch.float32
                and cos.shape[0] == sin.shape[0] == rows
                and cos.shape[-1] == sin.shape[-1] == self.d == cos.numel() // rows
                and cos.stride(-1) == sin.stride(-1) == 1 and cos.stride(0) == sin.stride(0)):
            return None
        # kept in variables: a temporary's pointer would dangle once it is collected
        hidden = hidden.contiguous()
        residual = None if residual is None else residual.contiguous()
        if self._pure_decode(rows, ctx):
            done = self._decode(hidden, residual, cos, sin, ctx)
            if done is not None:
                return done
        if self._panels is None:
            return None
        return self._halves(hidden, residual, cos, sin, ctx)

    def _pure_decode(self, rows: int, ctx: ForwardContext) -> bool:
        """Whether every row is the one new token of its own sequence, in order."""
        meta = ctx.metadata
        if not isinstance(meta, CpuSdpaMetadata) or len(meta.groups) != 1:
            return False
        group = meta.groups[0]
        return (group.decode_tables is not None and group.num_seqs == rows
                and group.token_idx is None)

    def _decode(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                cos: torch.Tensor, sin: torch.Tensor,
                ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The whole layer in one call, attention included; None when the cache or the
        weights do not fit it."""
        rows = hidden.shape[0]
        meta = ctx.metadata
        group = meta.groups[0]
        kv_cache = ctx.kv_caches[self.layer_idx]
        if not (kv_cache.dtype == torch.float32 and kv_cache.is_contiguous()
                and kv_cache.shape[3:] == (self.hkv, self.d)):
            return None
        use_compact = rows == 1 and self._compact is not None
        if not use_compact and self._panels is None:
            return None
        out = torch.empty_like(hidden)
        new_residual = torch.empty_like(hidden)
        half = kv_cache[0].numel() * kv_cache.element_size()
        base = kv_cache.data_ptr()
        residual_ptr = None if residual is None else residual.data_ptr()
        if use_compact:
            qkv, o, gate_up, down = self._compact
            failed = self.native.decode_layer_f32(
                hidden.data_ptr(), residual_ptr, self.hidden, self.norm_in.data_ptr(),
                self.norm_post.data_ptr(), self.eps, qkv, o, gate_up, down, cos.data_ptr(),
                sin.data_ptr(), base, base + half, int(meta.slot_mapping[0]),
                group.decode_tables.data_ptr(), int(group.lens[0]), kv_cache.shape[2],
                self.window, self.hq, self.hkv, self.d, self.scale, out.data_ptr(),
                new_residual.data_ptr())
        else:
            qkv, o, gate_up, down = self._panels
            tables, lens, slots = group.decode_tables, group.lens, meta.slot_mapping
            if not (tables.stride(1) == 1 and lens.is_contiguous() and slots.is_contiguous()
                    and lens.dtype == slots.dtype == tables.dtype == torch.int64):
                return None
            failed = self.native.decode_batch_f32(
                rows, hidden.data_ptr(), residual_ptr, self.hidden, self.norm_in.data_ptr(),
                self.norm_post.data_ptr(), self.eps, qkv, o, gate_up, down, cos.data_ptr(),
                sin.data_ptr(), cos.stride(0), base, base + half, slots.data_ptr(),
                tables.data_ptr(), tables.stride(0), lens.data_ptr(), kv_cache.shape[2],
                self.window, self.hq, self.hkv, self.d, self.scale, out.data_ptr(),
                new_residual.data_ptr())
        return None if failed else (out, new_residual)

    def _halves(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                cos: torch.Tensor, sin: torch.Tensor,
                ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Any other step (prompts, mixed steps): the layer before and after attention
        in C, the attention backend in between, which writes the cache as it does for
        the op-by-op path."""
        rows = hidden.shape[0]
        hq, hkv, d = self.hq, self.hkv, self.d
        qkv, o, gate_up, down = self._panels
        qkv_out = hidden.new_empty(rows, (hq + 2 * hkv) * d)
        new_residual = torch.empty_like(hidden)
        failed = self.native.layer_front_f32(
            rows, hidden.data_ptr(), None if residual is None else residual.data_ptr(),
            self.hidden, self.norm_in.data_ptr(), self.eps, qkv, cos.data_ptr(),
            sin.data_ptr(), cos.stride(0), hq, hkv, d, qkv_out.data_ptr(),
            new_residual.data_ptr())
        if failed:
            return None
        q, k, v = qkv_out.split([hq * d, hkv * d, hkv * d], dim=-1)
        attn = ctx.attention(self.layer_idx, q.view(rows, hq, d), k.view(rows, hkv, d),
                             v.view(rows, hkv, d), scale=self.scale,
                             sliding_window=self.window or None)
        attn = attn.reshape(rows, hq * d).contiguous()
        out = torch.empty_like(hidden)
        # new_residual already holds residual + x, so a failure here cannot fall back
        # to the op-by-op path (the cache is written too): it is a bug, not a decline
        if self.native.layer_back_f32(rows, attn.data_ptr(), self.hidden,
                                      new_residual.data_ptr(), self.norm_post.data_ptr(),
                                      self.eps, o, gate_up, down, out.data_ptr()):
            raise RuntimeError("quire_layer_back_f32 refused shapes its front accepted")
        return out, new_residual


def _bias(module: nn.Module) -> torch.Tensor | None:
    bias = getattr(module, "bias", None)
    return None if bias is None else bias.detach()


def _qualifies(layer: nn.Module) -> bool:
    # imported here: quire.models.llama pulls in torch._dynamo (and with it triton),
    # which platform discovery must not import
    from quire.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP

    if type(layer) is not LlamaDecoderLayer:
        return False
    attn, mlp = layer.self_attn, layer.mlp
    if type(attn) is not LlamaAttention or type(mlp) is not LlamaMLP or attn.q_norm is not None:
        return False
    if attn.o_proj.comm.world_size != 1:
        return False
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if any(type(n) is not RMSNorm or n.weight.dtype != torch.float32 for n in norms):
        return False
    if norms[0].eps != norms[1].eps:  # the kernel takes one eps; HF configs have one
        return False
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    if not all(isinstance(m.kernel, PackedLinear)
               and (m.bias is None or m.bias.dtype == torch.float32) for m in linears):
        return False
    return (all(m.kernel.compact is not None for m in linears)
            or all(m.kernel.panels is not None for m in linears))


def install_fused_decode(model: nn.Module, native: NativeKernels) -> int:
    """Give every qualifying decoder layer of ``model`` a :class:`FusedDecodeLayer`
    (after :func:`~quire.platforms.cpu.packed_linear.pack_linear_weights`).

    :returns: how many layers got one.
    """
    installed = 0
    for module in model.modules():
        if _qualifies(module):
            module.kernel = FusedDecodeLayer(native, module)
            installed += 1
    logger.info("cpu platform: %d decoder layers run decode steps in one C call", installed)
    return installed
