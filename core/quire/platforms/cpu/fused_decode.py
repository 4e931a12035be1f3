"""Decoder layers in C for every step, attention included for decode steps, built from
the description each layer publishes (:class:`~quire.ops.layer_spec.DecoderLayerSpec`).

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
- *a lone sequence's last few tokens* (speculative decoding's verification: its last
  token and its drafts, up to :data:`LAST_ROWS_MAX`): the same whole layer for those
  rows, ``quire_decode_rows_f32``, each weight read once for up to 4 rows, every
  token's K/V written before any attends. Op by op, two rows took nearly twice one.
- *any other step* (prompts, chunks after a cached prefix, mixed steps), on panels:
  the layer before attention (``quire_layer_front_f32``: residual, norm, QKV, rotary)
  and after it (``quire_layer_back_f32``: output projection, residual, norm, gated MLP)
  in C, and the attention backend in between, which writes the cache and attends as
  it does for the op-by-op path. A 2048-token prompt step of SmolLM2 went from 3.16 s
  to 2.97 s (alternating the two in one process).

A layer qualifies when its description fits the C layer (any of its norms, q/k norms,
SiLU or GELU-tanh, no logit soft cap), it runs on one device (no all-reduce), its norms
are float32 (or all bfloat16, below) with one eps, and each of its linears is a
:class:`~quire.platforms.cpu.packed_linear.PackedLinear` with a compact encoding
(:mod:`~quire.platforms.cpu.compact`: GGUF Q4_0/Q4_1/Q5_0/Q8_0 weights and bf16
checkpoints), float32 panels (the native panel kernel, AVX2 hosts) or, in a bfloat16
model, bfloat16 pair panels (AVX512_BF16 hosts) or oneDNN's packed bfloat16 copy. A one-row step
streams the compact weights and runs the others on their panels in the same call; the
other steps need every linear on panels. The
whole-layer decode call also needs :class:`CpuSdpaAttentionBackend`'s metadata and a
contiguous KV cache of the model's dtype. What does not fit returns None and the layer
runs op by op. Results agree with that path to float32 rounding (the same kernels for
products, norms and attention; the activation and rotary in C instead of torch).

A bfloat16 model's layers qualify too. A lone sequence's decode step runs the whole C
layer in float32 from the bf16 weights' compact copies, reading and writing bfloat16
KV pages, its rows widened on the way in and rounded on the way out. Its other decode
steps, where all four products stay on bfloat16 pair panels (``csrc/panel_bf16.c``,
AVX512_BF16; :mod:`~quire.platforms.cpu.dispatch` may move a shape to oneDNN), run the
whole layer in one call too (``quire_decode_batch_bf16``: the float32 batch layer,
each product's input rows rounded to bfloat16). Every other step (prompts, mixed
steps, decode batches with a product on oneDNN) runs each product on its own kernel
and what lies between them in C, one call per gap (``quire_rows_*``): residual and
norms, q/k norms and rotary, for decode steps the KV writes and paged attention too
(other steps attend through the backend), the activation. Both keep the residual
stream in float32 through a layer and round it once, where the op-by-op path rounds
it after each add. Numbers differ from the op-by-op bfloat16 path by bfloat16
rounding (the C layers round less often), not float32's.

A model on quantised weights (a GGUF file's blocks) runs its lone sequence's decode
steps as the whole C layer on the blocks, and its other steps as the bfloat16 steps
above (``quire_rows_*``), each product through the platform's ``quantized_linear`` on
the blocks (``csrc/quant_gemm.c``). In a float32 model the rows between the products
stay float32 (the C pieces copy them where a bfloat16 model's round them), so results
are the op-by-op path's to float32 rounding; the blocks have no float32 panels, which
would be a float copy of the weights.
"""

from __future__ import annotations

import ctypes
import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

from quire.ops.layer_spec import DecoderLayerSpec, NormSpec
from quire.ops.quantized import QuantizedLinearKernel
from quire.platforms.cpu.native import (
    KV_TYPES,
    LayerDescArgs,
    LinearArgs,
    NativeKernels,
    PanelArgs,
    QPartArgs,
    RowsArgs,
    StackLayerArgs,
    pages_fit,
)
from quire.platforms.cpu.packed_linear import PackedLinear
from quire.platforms.cpu.quant_linear import bf16_min_rows, takes_bf16_kernel, takes_bf16_rows
from quire.platforms.cpu.sdpa_attention import CpuSdpaMetadata

if TYPE_CHECKING:
    from quire.models.context import ForwardContext
    from quire.quantization.tensor import QuantizedTensor

logger = logging.getLogger(__name__)


#: Rows of a step's MLP computed at a time outside the C layers (:meth:`FusedDecodeLayer.
#: _mlp_rows`): bounds its temporaries; at 512 rows the blocks' products still take
#: their weights' unpacking over enough rows to pay for it.
MLP_BLOCK_ROWS = 512

#: Most tokens of one sequence the one-sequence C layer takes in a step (a verification
#: step's last token and drafts; speculative decoding allows 16 drafts).
LAST_ROWS_MAX = 17


class FusedDecodeLayer:
    """One layer's :class:`~quire.ops.layer_spec.DecoderLayerKernel`: the whole layer in
    C for decode steps, its halves in C around the attention backend for the rest."""

    def __init__(self, native: NativeKernels, spec: DecoderLayerSpec,
                 int8_decode: bool = False, int8_rows: bool = False,
                 bf16_decode: bool | None = None) -> None:
        """:param int8_decode: quantised weights' one-row products take int8 activations
            where the kernels have them (the ``decode_activations`` option).
        :param int8_rows: every row of those products does (``activations=int8``).
        :param bf16_decode: else, whether they take bfloat16 activations, None where
            each product follows its batches' (the op's rule,
            :func:`~quire.platforms.cpu.quant_linear.takes_bf16_rows`)."""
        self.native = native
        self._int8_decode, self._int8_rows = int8_decode, int8_rows
        self.layer_idx = spec.layer_idx
        self.hq, self.hkv, self.d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.scale = float(spec.scale)
        self.window = spec.sliding_window or 0
        self.hidden = spec.input_norm.weight.shape[0]
        #: the model's dtype: float32, or bfloat16 (rows converted at the call's edges,
        #: KV pages in bfloat16, weights streamed from their compact bf16 copies)
        self.dtype = spec.input_norm.weight.dtype
        # the norms' weights with their offsets added, in float32 (kept alive: the
        # struct points into them); _qualifies checked that they share one eps
        self._norms = {name: _effective_weight(getattr(spec, name)) for name in _NORMS}
        self._desc = LayerDescArgs(
            spec.input_norm.eps, LayerDescArgs.ACTIVATIONS[spec.activation],
            *(None if w is None else w.data_ptr() for w in self._norms.values()),
            spec.mlp is not None, self.dtype == torch.bfloat16)
        self.desc = ctypes.byref(self._desc)
        #: the MLP the C layer leaves to the model (mixture of experts), or None
        self.mlp = spec.mlp
        modules = [m for m in (spec.qkv, spec.o, spec.gate_up, spec.down) if m is not None]
        kernels = [_view(module.kernel) for module in modules]
        # float32 biases (copies of a bfloat16 model's), kept alive for the structs
        biases = [_bias(m) for m in modules]
        # ctypes structs pointing into the PackedLinears' tensors and the biases, which
        # live as long as the model; byref()s made once, not per call
        # one-row steps: each weight's compact encoding, or its panels where it has none
        # (GGUF K-quants and Q5 blocks have no exact encoding yet); worth it when some
        # weight is compact
        self._compact = None
        if (any(k.compact is not None for k in kernels)
                and all(k.compact is not None or _f32_panels(k) for k in kernels)):
            self._compact_args = [
                LinearArgs.of_parts(k.compact.parts, b,
                                    [self._part_acts(k.compact, p, int8_decode, bf16_decode)
                                     for p in k.compact.parts])
                if isinstance(k, _QuantizedView)
                else LinearArgs.of(k.compact, b) if k.compact is not None
                else LinearArgs.of_panels(k.panels, k.out_features, b)
                for k, b in zip(kernels, biases)]
            self._compact = _with_absent_mlp(
                [ctypes.byref(args) for args in self._compact_args])
        # every other step: float32 panels, or in a bfloat16 model bfloat16 pair panels
        # where dispatch left all four products on them (not when some run on oneDNN:
        # the bfloat16 batch then goes product by product, below)
        self._panels = None
        if all(k.panels is not None and k.packed is None and k.dtype == self.dtype
               for k in kernels):
            self._panel_args = [PanelArgs.of(k.panels, k.out_features, b, k.in_features)
                                for k, b in zip(kernels, biases)]
            self._panels = _with_absent_mlp(
                [ctypes.byref(args) for args in self._panel_args])
        self._biases = biases
        # the steps the layers above do not take: each product on its PackedLinear's
        # own choice (pair panels or oneDNN's packed copy) or its quantised parts' op
        # (the platform's quantized_linear on the blocks), with the modules' own biases;
        # the rest in C. A bfloat16 layer's other steps; a float32 layer's on quantised
        # weights, which have no float32 panels (a float copy of the weights)
        self._products = None
        if all(isinstance(k, _QuantizedView)
               or (self.dtype == torch.bfloat16 and k.dtype == torch.bfloat16
                   and (k.packed is not None or k.panels is not None))
               for k in kernels):
            self._products = _with_absent_mlp(
                [(_QuantizedProduct(native, k.compact, int8_rows)
                  if isinstance(k, _QuantizedView) else k, getattr(m, "bias", None))
                 for k, m in zip(kernels, modules)])
            inter = 0 if spec.gate_up is None else kernels[2].out_features // 2
            self._rows = RowsArgs(hidden=self.hidden, hq=self.hq, hkv=self.hkv, d=self.d,
                                  desc=ctypes.pointer(self._desc), window=self.window,
                                  scale=self.scale, inter=inter,
                                  rows_f32=self.dtype == torch.float32)
            self.rows_args = ctypes.byref(self._rows)
            self._out_norm = spec.mlp_out_norm is not None

    def __call__(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: tuple[torch.Tensor, torch.Tensor],
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        rows = hidden.shape[0]
        cos, sin = rotary
        if hidden.dtype != self.dtype or not self.rotary_fits(rows, cos, sin):
            return None
        # kept in variables: a temporary's pointer would dangle once it is collected
        hidden = hidden.contiguous()
        residual = None if residual is None else residual.contiguous()
        if self.dtype == torch.float32:
            done = self._float32(hidden, residual, cos, sin, ctx)
        elif residual is not None and residual.dtype != torch.bfloat16:
            return None
        elif self._compact is not None and (
                (rows == 1 and self._pure_decode(rows, ctx)) or self._last_rows(rows, ctx)):
            done = self._lone_bf16(hidden, residual, cos, sin, ctx)
        else:
            done = None
            if self._panels is not None and self._pure_decode(rows, ctx):
                done = self._decode(hidden, residual, cos.float(), sin.float(), ctx)
            if done is None and self._products is not None:
                done = self._rows_step(hidden, residual, cos, sin, ctx)
            if done is None:
                return None
        if done is None or self.mlp is None:
            return done
        return self.mlp(done[0], ctx), done[1]  # the C layer stopped at the MLP's input

    def rotary_fits(self, rows: int, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        """Whether the step's rotary factors are rows of ``d`` the C layer reads: the
        model's dtype or float32, row r at ``r * stride(0)``."""
        return (rows > 0 and cos.dtype == sin.dtype
                and cos.dtype in (torch.float32, self.dtype)
                and cos.shape[0] == sin.shape[0] == rows
                and cos.shape[-1] == sin.shape[-1] == self.d == cos.numel() // rows
                and cos.stride(-1) == sin.stride(-1) == 1 and cos.stride(0) == sin.stride(0))

    def _float32(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                 cos: torch.Tensor, sin: torch.Tensor,
                 ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A float32 layer's step: whole in C for decode steps, else its halves."""
        if cos.dtype != torch.float32:
            return None
        done = None
        if self._pure_decode(hidden.shape[0], ctx):
            done = self._decode(hidden, residual, cos, sin, ctx)
        elif self._compact is not None and self._last_rows(hidden.shape[0], ctx):
            done = self._decode(hidden, residual, cos, sin, ctx)
        if done is None and self._panels is not None:
            done = self._halves(hidden, residual, cos, sin, ctx)
        if done is None and self._products is not None:
            done = self._rows_step(hidden, residual, cos, sin, ctx)
        return done

    def _lone_bf16(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                   cos: torch.Tensor, sin: torch.Tensor,
                   ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A bfloat16 lone sequence's decode step (or its last rows), in float32 from the
        compact copies: its rows widened here and its outputs rounded back."""
        residual = None if residual is None else residual.float()
        done = self._decode(hidden.float(), residual, cos.float(), sin.float(), ctx)
        return None if done is None else (done[0].to(self.dtype), done[1].to(self.dtype))

    def lone_step(self, rows: int, ctx: ForwardContext) -> bool:
        """Whether the step is one the one-sequence C layer takes: one sequence's decode
        step, or its last few rows (:meth:`_last_rows`)."""
        return (self._compact is not None and self.mlp is None
                and ((rows == 1 and self._pure_decode(1, ctx)) or self._last_rows(rows, ctx)))

    def stack_args(self) -> StackLayerArgs | None:
        """This layer's part of a ``quire_decode_stack_f32`` call (its pages unset), or
        None where that call cannot take it: a bfloat16 layer, weights without the
        one-sequence layer's encodings, an MLP of its own (mixture of experts)."""
        if self._compact is None or self.mlp is not None or self.dtype != torch.float32:
            return None
        qkv, o, gate_up, down = self._compact_args
        return StackLayerArgs(ctypes.pointer(self._desc), ctypes.pointer(qkv),
                              ctypes.pointer(o), ctypes.pointer(gate_up),
                              ctypes.pointer(down), None, None, self.window, self.scale)

    def batch_kernel(self, rows: int, ctx: ForwardContext) -> int | None:
        """For a decode batch (every row the one new token of its own sequence), which
        products ``quire_rows_stack_f32`` (:mod:`~quire.platforms.cpu.fused_stack`) runs
        for this layer's step of ``rows`` rows, as :meth:`_rows_step` would call them (so
        that its results are that path's): a bit per product (1 qkv, 2 o, 4 gate/up,
        8 down) set where it takes the bfloat16 kernel, in one call for a layer's parts,
        and clear where it takes the blocks' direct path (few rows, or float32 products;
        its rows float32 or rounded to bfloat16 as each part's ``acts`` says; the C call
        declines rows past that path's). A weight of long rows
        keeps the direct path for more rows than a short one, so a batch of a few rows
        may take both. None for another step (int8 decode rows on the direct path), or
        where the layer is not a float32 one on quantised weights."""
        if not (self._pure_decode(rows, ctx) and self.dtype == torch.float32
                and self._products is not None
                and self._compact is not None and self.mlp is None and not self._int8_rows
                and 1 < rows <= MLP_BLOCK_ROWS
                and all(isinstance(p, _QuantizedProduct) and not p.kernel.rotated
                        for p, _ in self._products)):
            return None
        bf16 = [p.bf16_batch(rows) for p, _ in self._products]
        if self._int8_decode and not all(bf16):
            return None
        return sum(1 << i for i, taken in enumerate(bf16) if taken)

    def _part_acts(self, kernel: QuantizedLinearKernel, part: QuantizedTensor,
                   int8_decode: bool, bf16_decode: bool | None) -> int:
        """The activations of a part's one-row products (:class:`QPartArgs`), as the
        platform's op takes them for the part."""
        if int8_decode and self.native.quant_q8_fits(part):
            return QPartArgs.Q8
        if takes_bf16_rows(self.native, part, self.dtype == torch.bfloat16, bf16_decode,
                           kernel.bf16_activations):
            return QPartArgs.BF16
        return QPartArgs.F32

    def _pure_decode(self, rows: int, ctx: ForwardContext) -> bool:
        """Whether every row is the one new token of its own sequence, in order."""
        meta = ctx.metadata
        if not isinstance(meta, CpuSdpaMetadata) or len(meta.groups) != 1:
            return False
        group = meta.groups[0]
        return (group.decode_tables is not None and group.num_seqs == rows
                and group.token_idx is None)

    def _last_rows(self, rows: int, ctx: ForwardContext) -> bool:
        """Whether the step is the last few tokens of one sequence after its cached
        context (speculative decoding's verification: its last token and its drafts),
        which the one-sequence C layer takes as :data:`LAST_ROWS_MAX` rows at most. A
        prompt's first step is not (it runs the halves)."""
        meta = ctx.metadata
        if not isinstance(meta, CpuSdpaMetadata) or len(meta.groups) != 1:
            return False
        group = meta.groups[0]
        return (1 < rows <= LAST_ROWS_MAX and group.num_seqs == 1 and group.max_q == rows
                and group.token_idx is None and group.fresh_rows is None)

    def use_pages(self, kv_cache: torch.Tensor) -> None:
        """Tell the C layer what this step's pages hold (``kv_cache_dtype``): the model's
        dtype, or bfloat16 (rounded on write, widened on read), or int8 / fp8 rows with
        a scale each (quantised on write, dequantised on read)."""
        self._desc.kv_type = KV_TYPES[kv_cache.dtype]

    def _decode(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                cos: torch.Tensor, sin: torch.Tensor,
                ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The whole layer in one call, attention included; None when the cache or the
        weights do not fit it. A decode step's rows, or one sequence's last rows on the
        compact weights."""
        rows = hidden.shape[0]
        meta = ctx.metadata
        group = meta.groups[0]
        kv_cache = ctx.kv_caches[self.layer_idx]
        if not (pages_fit(kv_cache, self.hkv, self.d)
                and (kv_cache.dtype != torch.float32 or self.dtype == torch.float32)):
            return None
        self.use_pages(kv_cache)
        # float32 rows (a bfloat16 lone sequence's widened ones too) or bfloat16 ones
        one_sequence = group.num_seqs == 1 and (rows == 1 or group.decode_tables is None)
        use_compact = (one_sequence and self._compact is not None
                       and hidden.dtype == torch.float32)
        if not use_compact and (self._panels is None or group.decode_tables is None):
            return None
        out = torch.empty_like(hidden)
        new_residual = torch.empty_like(hidden)
        half = kv_cache[0].numel() * kv_cache.element_size()
        base = kv_cache.data_ptr()
        residual_ptr = None if residual is None else residual.data_ptr()
        if use_compact and rows > 1:
            qkv, o, gate_up, down = self._compact
            table, slots = group.tables, meta.slot_mapping
            if not (table.is_contiguous() and slots.is_contiguous()
                    and table.dtype == slots.dtype == torch.int64):
                return None
            failed = self.native.decode_rows_f32(
                rows, hidden.data_ptr(), residual_ptr, self.hidden, self.desc, qkv, o,
                gate_up, down, cos.data_ptr(), sin.data_ptr(), cos.stride(0), base,
                base + half, slots.data_ptr(), table.data_ptr(), int(group.lens[0]),
                kv_cache.shape[2], self.window, self.hq, self.hkv, self.d, self.scale,
                out.data_ptr(), new_residual.data_ptr())
        elif use_compact:
            qkv, o, gate_up, down = self._compact
            failed = self.native.decode_layer_f32(
                hidden.data_ptr(), residual_ptr, self.hidden, self.desc, qkv, o, gate_up,
                down, cos.data_ptr(),
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
            entry = (self.native.decode_batch_f32 if hidden.dtype == torch.float32
                     else self.native.decode_batch_bf16)
            failed = entry(
                rows, hidden.data_ptr(), residual_ptr, self.hidden, self.desc, qkv, o,
                gate_up, down, cos.data_ptr(),
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
            self.hidden, self.desc, qkv, cos.data_ptr(),
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
                                      new_residual.data_ptr(), self.desc, o, gate_up, down,
                                      out.data_ptr()):
            raise RuntimeError("quire_layer_back_f32 refused shapes its front accepted")
        return out, new_residual

    def _rows_step(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                   cos: torch.Tensor, sin: torch.Tensor,
                   ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A step of several rows (or one without compact copies) whose products run
        outside C: each product one call (oneDNN, pair panels or the quantised op), what
        lies between them one C call (``quire_rows_*``); a decode step's attention in C
        too, any other step's by the attention backend. None when the inputs do not fit
        (nothing written yet)."""
        rows, hq, hkv, d = hidden.shape[0], self.hq, self.hkv, self.d
        native, args, ref = self.native, self._rows, self.rows_args
        (qkv_w, qkv_b), (o_w, o_b), gate_up, down = self._products
        stream = torch.empty(rows, self.hidden, dtype=torch.float32)
        normed = torch.empty_like(hidden)
        args.rows, args.x, args.stream, args.normed = (rows, hidden.data_ptr(),
                                                       stream.data_ptr(), normed.data_ptr())
        args.residual = None if residual is None else residual.data_ptr()
        if native.rows_front(ref):
            return None
        qkv = qkv_w(normed, qkv_b).contiguous()
        if qkv.dtype != self.dtype:
            return None
        args.qkv, args.cos, args.sin = qkv.data_ptr(), cos.data_ptr(), sin.data_ptr()
        args.rot_stride, args.rot_bf16 = cos.stride(0), cos.dtype == torch.bfloat16
        attn = self._decode_attention_rows(rows, ctx) if self._pure_decode(rows, ctx) else None
        if attn is None:  # the backend writes the cache and attends
            if native.rows_rotate(ref):
                return None
            q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
            attn = ctx.attention(self.layer_idx, q.view(rows, hq, d), k.view(rows, hkv, d),
                                 v.view(rows, hkv, d), scale=self.scale,
                                 sliding_window=self.window or None)
            attn = attn.reshape(rows, hq * d).to(self.dtype).contiguous()
        # the cache is written now: a refusal below is a bug, not a decline
        o_out = o_w(attn, o_b).contiguous()
        new_residual = torch.empty_like(hidden)
        args.o_out, args.residual_out = o_out.data_ptr(), new_residual.data_ptr()
        _check(native.rows_post_attn(ref), "quire_rows_post_attn")
        del qkv, attn, o_out  # done with: the MLP's products take their place
        if gate_up is None:  # the MLP runs outside, on normed
            return normed, new_residual
        out = self._mlp_rows(normed, gate_up, down)
        args.rows = rows
        if self._out_norm:
            args.out = out.data_ptr()
            _check(native.rows_out_norm(ref), "quire_rows_out_norm")
        return out, new_residual

    def _mlp_rows(self, normed: torch.Tensor, gate_up: tuple, down: tuple) -> torch.Tensor:
        """``down(act(gate(normed)) * up(normed))``, :data:`MLP_BLOCK_ROWS` rows at a time:
        a prompt chunk's gate/up products and activations are the step's largest
        temporaries (3 x intermediate floats a row), and only one block of them lives
        at once. Leaves ``self._rows.rows`` at the last block's rows."""
        rows, args = normed.shape[0], self._rows
        out = None
        for r0 in range(0, rows, MLP_BLOCK_ROWS):
            block = normed[r0:r0 + MLP_BLOCK_ROWS]
            gu = gate_up[0](block, gate_up[1]).contiguous()
            act = normed.new_empty(block.shape[0], args.inter)
            args.rows, args.gate_up, args.act = block.shape[0], gu.data_ptr(), act.data_ptr()
            _check(self.native.rows_act(self.rows_args), "quire_rows_act")
            part = down[0](act, down[1])
            if block.shape[0] == rows:
                return part.contiguous()
            if out is None:
                out = part.new_empty(rows, part.shape[-1])
            out[r0:r0 + block.shape[0]] = part
        return out

    def _decode_attention_rows(self, rows: int, ctx: ForwardContext) -> torch.Tensor | None:
        """A decode step's q/k norms, rotary, cache writes and attention in one C call:
        the attention rows in the model's dtype, or None when the cache (pages of
        :data:`~quire.platforms.cpu.native.KV_TYPES`) or tables do not fit it (nothing
        written then)."""
        group, slots = ctx.metadata.groups[0], ctx.metadata.slot_mapping
        kv_cache = ctx.kv_caches[self.layer_idx]
        tables, lens = group.decode_tables, group.lens
        if not (pages_fit(kv_cache, self.hkv, self.d)
                and tables.stride(1) == 1 and lens.is_contiguous() and slots.is_contiguous()
                and lens.dtype == slots.dtype == tables.dtype == torch.int64):
            return None
        attn = torch.empty(rows, self.hq * self.d, dtype=self.dtype)
        args = self._rows
        base = kv_cache.data_ptr()
        args.k_cache = base
        args.v_cache = base + kv_cache[0].numel() * kv_cache.element_size()
        self.use_pages(kv_cache)
        args.slots, args.tables, args.seq_lens = (slots.data_ptr(), tables.data_ptr(),
                                                  lens.data_ptr())
        args.table_stride, args.block_size = tables.stride(0), kv_cache.shape[2]
        args.attn = attn.data_ptr()
        return None if self.native.rows_attend(self.rows_args) else attn


class _QuantizedView:
    """What :class:`FusedDecodeLayer` reads of a quantised layer's kernel
    (:class:`~quire.ops.quantized.QuantizedLinearKernel`, kept as ``compact``): its parts
    as the one-row weight (``struct quire_linear`` format QUANT), no panels. A lone
    sequence's decode steps run the layer in C; other steps run the C steps between
    products, the kernel as a product (:class:`_QuantizedProduct`)."""

    panels = None
    packed = None
    dtype = torch.float32

    def __init__(self, kernel: QuantizedLinearKernel) -> None:
        self.compact = kernel
        self.out_features = kernel.out_features
        self.in_features = kernel.parts[0].cols


class _QuantizedProduct:
    """A quantised layer's product in :meth:`FusedDecodeLayer._rows_step`. Where the
    platform's op would multiply every part on the bfloat16 kernel (the op's rule,
    :func:`~quire.platforms.cpu.quant_linear.takes_bf16_kernel`, and no int8 rows), all
    the parts in one call (:meth:`NativeKernels.quant_parts_bf16`: one parallel region,
    no ``cat``), the same numbers as the op gives part by part; else the layer's
    kernel, part by part."""

    def __init__(self, native: NativeKernels, kernel: QuantizedLinearKernel,
                 int8_rows: bool) -> None:
        self.native = native
        self.kernel = kernel
        # structs into the parts' blocks, which live as long as the model
        self._parts = QPartArgs.array(kernel.parts)
        self._one_call = (len(kernel.parts) > 1 and not kernel.padding and not int8_rows
                          and kernel.parts[0].cols % 2 == 0)

    def bf16_batch(self, rows: int) -> bool:
        """Whether ``rows`` float32 rows take the bfloat16 kernel here, in one call for
        all the parts (``quire_quant_gemm_bf16_parts``) or for the one part
        (``quire_quant_gemm_bf16_f32``, through the platform's op)."""
        kernel = self.kernel
        return (kernel.bf16_activations
                and (self._one_call or len(kernel.parts) == 1)
                and self.native.has_quant_bf16
                and rows > bf16_min_rows(kernel.parts[0].cols))

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if (self._one_call and x.dim() == 2 and x.dtype in (torch.float32, torch.bfloat16)
                and takes_bf16_kernel(self.native, x, x.shape[1],
                                      self.kernel.bf16_activations)):
            y = self.native.quant_parts_bf16(x.contiguous(), self._parts,
                                             self.kernel.out_features)
            if y is not None:
                y = y.to(x.dtype)  # as the op rounds each part's result
                return y if bias is None else y + bias
        return self.kernel(x, bias)


def _view(kernel: object) -> object:
    return _QuantizedView(kernel) if isinstance(kernel, QuantizedLinearKernel) else kernel


def _fusable_quantized(kernel: object) -> bool:
    """A quantised layer whose one-row products the C layer computes as the op does:
    float activations (not w8a8), every part on the host, no padding rows."""
    return (isinstance(kernel, QuantizedLinearKernel) and not kernel.int8_activations
            and not kernel.padding and all(p.device.type == "cpu" for p in kernel.parts))


def _f32_panels(kernel: PackedLinear) -> bool:
    """Whether ``kernel`` keeps float32 panels (a one-row layer's ``quire_linear`` can
    read those; not bfloat16 pair panels)."""
    return kernel.panels is not None and kernel.panels.dtype == torch.float32


def _check(failed: int, entry: str) -> None:
    if failed:
        raise RuntimeError(f"{entry} refused shapes quire_rows_front accepted")


#: The description's norms, in ``struct quire_layer_desc`` order after norm_in.
_NORMS = ("input_norm", "pre_mlp_norm", "q_norm", "k_norm", "attn_out_norm", "mlp_out_norm")


def _with_absent_mlp(args: list) -> list:
    """Four linear arguments for the C calls: a layer whose MLP runs outside passes
    NULL for gate_up and down, which the C layer then never reads."""
    return args + [None] * (4 - len(args))


def _effective_weight(norm: NormSpec | None) -> torch.Tensor | None:
    """The weight the C norm multiplies by: ``offset + weight`` (Gemma's ``1 + w``)."""
    if norm is None:
        return None
    weight = norm.weight.detach().float()
    return (weight + norm.offset).contiguous() if norm.offset else weight.contiguous()


def _bias(module: nn.Module) -> torch.Tensor | None:
    """A linear's bias in float32 (the C layer's), or None."""
    bias = getattr(module, "bias", None)
    return None if bias is None else bias.detach().float().contiguous()


def decline_reason(spec: DecoderLayerSpec) -> str | None:
    """Why the C layer cannot run ``spec``, or None when it can."""
    if spec.world_size != 1:
        return "tensor parallel (the C layer has no all-reduce)"
    if spec.logits_soft_cap is not None:
        return "attention logit soft cap"
    if spec.activation not in LayerDescArgs.ACTIVATIONS:
        return f"activation {spec.activation!r}"
    if (spec.q_norm is None) != (spec.k_norm is None):
        return "a q norm without a k norm"
    if spec.mlp is not None and spec.mlp_out_norm is not None:
        return "a norm after an MLP that runs outside"
    if spec.mlp is None and (spec.gate_up is None or spec.down is None):
        return "neither gated MLP sites nor an MLP to call"
    norms = spec.norms()
    dtypes = {n.weight.dtype for n in norms}
    if len(dtypes) != 1 or dtypes - {torch.float32, torch.bfloat16} or any(
            n.weight.device.type != "cpu" for n in norms):
        return "norm weights not float32 or bfloat16 on the host"
    if len({n.eps for n in norms}) != 1:
        return "norms with different eps"
    linears = [m for m in (spec.qkv, spec.o, spec.gate_up, spec.down) if m is not None]
    if not all(isinstance(getattr(m, "kernel", None), PackedLinear)
               or _fusable_quantized(getattr(m, "kernel", None)) for m in linears):
        return "linears neither packed nor quantised with float activations"
    if not all(getattr(m, "bias", None) is None or m.bias.dtype in dtypes for m in linears):
        return "biases of another dtype than the norms"
    kernels = [_view(m.kernel) for m in linears]
    if not all(k.compact is not None or k.panels is not None
               or (k.dtype == torch.bfloat16 and k.packed is not None)
               for k in kernels):  # (a bfloat16 layer's products may run on oneDNN)
        return "linears with neither a compact copy nor panels"
    return None


def install_fused_decode(model: nn.Module, native: NativeKernels,
                         int8_decode: bool = False, int8_rows: bool = False,
                         bf16_decode: bool | None = None) -> dict[str, int]:
    """Give every decoder layer of ``model`` whose description the C layer runs a
    :class:`FusedDecodeLayer` (after
    :func:`~quire.platforms.cpu.packed_linear.pack_linear_weights`).

    :returns: layers per outcome: ``"fused"``, or the reason a layer was declined.
    """
    outcomes: dict[str, int] = {}
    for module in model.modules():
        describe = getattr(module, "fusion_spec", None)
        if describe is None:
            continue
        spec = describe()
        reason = decline_reason(spec)
        if reason is None:
            module.kernel = FusedDecodeLayer(native, spec, int8_decode, int8_rows,
                                             bf16_decode)
        outcomes[reason or "fused"] = outcomes.get(reason or "fused", 0) + 1
    declined = {k: v for k, v in outcomes.items() if k != "fused"}
    logger.info("cpu platform: %d decoder layers run in C%s", outcomes.get("fused", 0),
                "".join(f"; {n} not ({why})" for why, n in declined.items()))
    return outcomes
