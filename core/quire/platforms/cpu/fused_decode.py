"""A Llama-family decoder layer in one C call for decode steps.

A decode step's layer, run op by op, is ~20 torch operators and C calls. For a lone
sequence (``quire bench latency``, a chat on a laptop) on SmolLM2-135M their dispatch
was about half of each layer's time once the weights streamed from their compact
encoding; for a batch of 64 (W1) the small operators (KV writes by ``index_copy``,
SiLU and products, the rotary's roll) and the Python around them took ~40 ms of a
~220 ms step. :class:`FusedDecodeLayer` hands the whole layer (norm, QKV, rotary, KV
write, paged attention, output projection, norm, gated MLP) to ``csrc/decode_layer.c``
when:

- every row of the step is the one new token of its own sequence (a pure decode step),
  on :class:`CpuSdpaAttentionBackend`'s metadata, with a float32 contiguous KV cache;
- the layer is :class:`~quire.models.llama.LlamaDecoderLayer` without q/k norms, on
  one device (no all-reduce), with plain :class:`RMSNorm` s;
- and its four linears are :class:`~quire.platforms.cpu.packed_linear.PackedLinear` s
  that either all have a compact encoding (:mod:`~quire.platforms.cpu.compact`:
  GGUF Q4_0/Q4_1/Q8_0 weights and bf16 checkpoints) or all keep float32 panels (the
  native panel kernel, AVX2 hosts).

A lone sequence on compact weights runs ``quire_decode_layer_f32`` (weights streamed
from their encoding, one row); every other qualifying step runs
``quire_decode_batch_f32`` on the panels, which covers float32 checkpoints and batches.
Anything else (a prompt, a mixed step, another layer type) returns None and the layer
runs as written. Results agree with that path to float32 rounding (the same kernels for
products, norms and attention; the SiLU and rotary in C instead of torch).
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
    """One layer's :class:`~quire.models.llama.DecoderLayerKernel`: the C path for
    decode steps."""

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
        meta = ctx.metadata
        rows = hidden.shape[0]
        if not isinstance(meta, CpuSdpaMetadata) or len(meta.groups) != 1:
            return None
        group = meta.groups[0]
        # a pure decode step: one group of decode rows, all rows in order
        if group.decode_tables is None or group.num_seqs != rows or group.token_idx is not None:
            return None
        kv_cache = ctx.kv_caches[self.layer_idx]
        cos, sin = rotary
        if not (kv_cache.dtype == hidden.dtype == torch.float32 and kv_cache.is_contiguous()
                and kv_cache.shape[3:] == (self.hkv, self.d)
                and cos.dtype == sin.dtype == torch.float32
                and cos.shape[0] == sin.shape[0] == rows
                and cos.shape[-1] == sin.shape[-1] == self.d == cos.numel() // rows
                and cos.stride(-1) == sin.stride(-1) == 1 and cos.stride(0) == sin.stride(0)):
            return None
        use_compact = rows == 1 and self._compact is not None
        if not use_compact and self._panels is None:
            return None
        # kept in variables: a temporary's pointer would dangle once it is collected
        hidden = hidden.contiguous()
        residual = None if residual is None else residual.contiguous()
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
        if failed:
            return None
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
