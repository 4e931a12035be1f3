"""A lone sequence's step through all of a model's decoder layers in one C call
(``quire_decode_stack_f32`` of ``csrc/decode_layer.c``).

Each :class:`~quire.platforms.cpu.fused_decode.FusedDecodeLayer` already runs its layer
in one call, but a call per layer still costs the step a Python dispatch (the layer's
checks, its output tensors, the ctypes call) and an OpenMP parallel region, whose team
waits while the dispatch runs: a sizeable share of a small model's lone decode step
(docs/bench.md, issue 29's W2 rows). :class:`FusedDecodeStack` runs the
layers of a model's forward (``model.layers_kernel``, :mod:`quire.ops.layer_spec`) as
one call and one parallel region, for the steps the one-sequence C layer takes: a
decode step of one sequence, or its last few tokens (speculative decoding's
verification), float32 rows on the layers' compact or quantised weights. The layers
compute what they compute one call at a time (the same C per layer), so results match
that path to float32 rounding.

A float32 model's decode batches on quantised weights take one call too
(``quire_rows_stack_f32``), each product on the kernel a call of its own would take:
the bfloat16 one or, for a few rows or float32 products, the blocks' direct path (its
rows float32 or bfloat16 as each part says;
:meth:`~quire.platforms.cpu.fused_decode.FusedDecodeLayer.batch_kernel`): the
steps a layer runs between its products (``quire_rows_*``) and the products themselves,
in the order of a call per product and per gap, whose Python dispatch and parallel
regions left the other threads waiting (docs/bench.md has the share of a W1 run). The
same kernels on the same rows, so results are that path's exactly.

Any other step, or a range with a layer the C layer does not take (not fused, a
mixture-of-experts MLP, a kernel LoRA took away), returns None and the layers run one
by one.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from quire.platforms.cpu.fused_decode import FusedDecodeLayer
from quire.platforms.cpu.native import NativeKernels, StackLayerArgs, pages_fit

if TYPE_CHECKING:
    from quire.models.context import ForwardContext

_STRIDE = ctypes.sizeof(StackLayerArgs)
_POINTER = ctypes.sizeof(ctypes.c_void_p)


class FusedDecodeStack:
    """A model's :class:`~quire.ops.layer_spec.DecoderStackKernel` over its ``layers``:
    a lone sequence's steps, and decode batches on quantised weights."""

    def __init__(self, native: NativeKernels, layers: Sequence[nn.Module]) -> None:
        self.native = native
        self._layers = list(layers)
        kernels = [getattr(layer, "kernel", None) for layer in self._layers]
        args = [k.stack_args() if isinstance(k, FusedDecodeLayer) else None for k in kernels]
        #: each layer's fused kernel where the one-sequence C call takes it, else None
        self._fused: list[FusedDecodeLayer | None] = [
            k if a is not None else None for k, a in zip(kernels, args)]
        shapes = {(k.hidden, k.hq, k.hkv, k.d) for k in self._fused if k is not None}
        if len(shapes) > 1:  # the C call takes one shape for every layer
            self._fused = [None] * len(self._fused)
        # one struct per layer, pointing into the layers' own argument structs (which live
        # as long as the layers); the pages are filled in when first seen
        self._array = (StackLayerArgs * len(self._layers))()
        for i, a in enumerate(args):
            if a is not None:
                self._array[i] = a
        self._cos = (ctypes.c_void_p * len(self._layers))()
        self._sin = (ctypes.c_void_p * len(self._layers))()
        self._pages: tuple | None = None  # the KV tensors the array points into

    def __call__(
        self,
        start: int,
        end: int,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rotaries: Sequence[tuple[torch.Tensor, torch.Tensor]],
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        rows = hidden.shape[0]
        if (hidden.dtype != torch.float32 or end - start != len(rotaries)
                or not self._takes(start, end)
                or (residual is not None and residual.dtype != torch.float32)):
            return None
        first = self._fused[start]
        if not first.lone_step(rows, ctx):
            return self._batch(start, end, hidden, residual, rotaries, ctx)
        meta = ctx.metadata
        group = meta.groups[0]
        table = group.decode_tables if rows == 1 else group.tables
        slots = meta.slot_mapping
        if not self._ready(start, end, rows, table, slots, rotaries, ctx):
            return None
        hidden, residual, out, new_residual = _rows_in_out(hidden, residual)
        failed = self.native.decode_stack_f32(
            end - start, ctypes.addressof(self._array) + start * _STRIDE, rows,
            hidden.data_ptr(), None if residual is None else residual.data_ptr(),
            first.hidden, ctypes.addressof(self._cos) + start * _POINTER,
            ctypes.addressof(self._sin) + start * _POINTER, rotaries[0][0].stride(0),
            slots.data_ptr(), table.data_ptr(), int(group.lens[0]),
            ctx.kv_caches[first.layer_idx].shape[2], first.hq, first.hkv, first.d,
            out.data_ptr(), new_residual.data_ptr())
        return None if failed else (out, new_residual)

    def _batch(self, start: int, end: int, hidden: torch.Tensor,
               residual: torch.Tensor | None,
               rotaries: Sequence[tuple[torch.Tensor, torch.Tensor]],
               ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A decode batch on quantised weights (``quire_rows_stack_f32``): every row the
        one new token of its own sequence, every layer's products on the kernels
        :meth:`~quire.platforms.cpu.fused_decode.FusedDecodeLayer.batch_kernel` names
        (the same for every layer of the range); else None."""
        rows = hidden.shape[0]
        first = self._fused[start]
        kernels = {self._fused[i].batch_kernel(rows, ctx) for i in range(start, end)}
        if len(kernels) != 1 or None in kernels:
            return None
        meta = ctx.metadata
        group, slots = meta.groups[0], meta.slot_mapping
        tables, lens = group.decode_tables, group.lens
        if not (lens.is_contiguous() and lens.dtype == torch.int64
                and self._ready(start, end, rows, tables, slots, rotaries, ctx)):
            return None
        hidden, residual, out, new_residual = _rows_in_out(hidden, residual)
        failed = self.native.rows_stack_f32(
            end - start, ctypes.addressof(self._array) + start * _STRIDE, rows,
            hidden.data_ptr(), None if residual is None else residual.data_ptr(),
            first.hidden, ctypes.addressof(self._cos) + start * _POINTER,
            ctypes.addressof(self._sin) + start * _POINTER, rotaries[0][0].stride(0),
            slots.data_ptr(), tables.data_ptr(), tables.stride(0), lens.data_ptr(),
            ctx.kv_caches[first.layer_idx].shape[2], first.hq, first.hkv, first.d,
            kernels.pop(), out.data_ptr(), new_residual.data_ptr())
        if failed == 3:  # the pages are written: no falling back to the layers
            raise MemoryError("quire_rows_stack_f32: no scratch memory for a product")
        return None if failed else (out, new_residual)

    def _ready(self, start: int, end: int, rows: int, table: torch.Tensor,
               slots: torch.Tensor, rotaries: Sequence[tuple[torch.Tensor, torch.Tensor]],
               ctx: ForwardContext) -> bool:
        """Whether the step's block table rows and slots are what the C calls read, with
        the range's pages and rotary rows set for them."""
        return (table.stride(-1) == 1 and slots.is_contiguous()
                and table.dtype == slots.dtype == torch.int64
                and self._use_pages(start, end, ctx.kv_caches)
                and self._use_rotaries(start, rows, rotaries, self._fused[start]))

    def _takes(self, start: int, end: int) -> bool:
        """Whether every layer of the range is one the C call takes, its kernel still
        installed (LoRA's hooks take whole-layer kernels away)."""
        return 0 <= start < end <= len(self._layers) and all(
            self._fused[i] is not None and self._layers[i].kernel is self._fused[i]
            for i in range(start, end))

    def _use_pages(self, start: int, end: int, kv_caches: list[torch.Tensor]) -> bool:
        """Point the range's layers at their KV pages (the C kernels' dtype numbering in
        each layer's description), when the pages changed since the last step."""
        caches = kv_caches[self._fused[start].layer_idx:self._fused[end - 1].layer_idx + 1]
        key = tuple(kv.data_ptr() for kv in caches) + (caches[0].dtype,)
        if key == self._pages:
            return True
        self._pages = None
        for i in range(start, end):
            layer = self._fused[i]
            kv = kv_caches[layer.layer_idx]
            if not (pages_fit(kv, layer.hkv, layer.d) and kv.dtype == caches[0].dtype):
                return False
            layer.use_pages(kv)
            half = kv[0].numel() * kv.element_size()
            self._array[i].k_cache = kv.data_ptr()
            self._array[i].v_cache = kv.data_ptr() + half
        self._pages = key
        return True

    def _use_rotaries(self, start: int, rows: int,
                      rotaries: Sequence[tuple[torch.Tensor, torch.Tensor]],
                      first: FusedDecodeLayer) -> bool:
        """Point each layer at its rotary rows: float32, as the layer reads them, one row
        stride for all."""
        stride = rotaries[0][0].stride(0)
        seen: set[int] = set()
        for i, (cos, sin) in enumerate(rotaries, start):
            if id(cos) not in seen:
                if not (cos.dtype == torch.float32 and cos.stride(0) == stride
                        and first.rotary_fits(rows, cos, sin)):
                    return False
                seen.add(id(cos))
            self._cos[i] = cos.data_ptr()
            self._sin[i] = sin.data_ptr()
        return True


def _rows_in_out(hidden: torch.Tensor, residual: torch.Tensor | None) -> tuple:
    """The step's rows as the C calls read them, and the two outputs they write: kept in
    variables, since a temporary's pointer would dangle once it is collected."""
    hidden = hidden.contiguous()
    residual = None if residual is None else residual.contiguous()
    return hidden, residual, torch.empty_like(hidden), torch.empty_like(hidden)


def install_fused_stack(model: nn.Module, native: NativeKernels) -> int:
    """Give every module of ``model`` that runs decoder layers (``layers_kernel``) a
    :class:`FusedDecodeStack` over them (after
    :func:`~quire.platforms.cpu.fused_decode.install_fused_decode`). :returns: how many."""
    installed = 0
    for module in model.modules():
        if hasattr(module, "layers_kernel") and isinstance(
                getattr(module, "layers", None), nn.ModuleList):
            stack = FusedDecodeStack(native, module.layers)
            if any(k is not None for k in stack._fused):
                module.layers_kernel = stack
                installed += 1
    return installed
