"""The cpu platform's native kernels: C sources in ``csrc/``, built with the package.

Why C and not torch ops: paged decode attention in torch has to gather every
sequence's keys and values into a padded copy and read that copy again, three passes
over the KV data for one of useful work; on a memory-bound CPU that is most of the
attention time. The kernel (``paged_decode.c``) reads the pages in place. And a
one-row product over weights in a compact exact encoding (``compact_gemv.c``, see
:mod:`~quire.platforms.cpu.compact`) has no torch operator: torch would have to expand
the weight to float32 in memory first, which is the traffic it exists to avoid.

Where the library comes from: the package build compiles one library per ISA level
(:mod:`~quire.platforms.cpu.isa`: generic, AVX2, AVX-512 on x86; generic, NEON on Arm)
into the package (:mod:`~quire.platforms.cpu.kernel_build`), so users need no
compiler; the level is chosen at run time from what the running CPU reports (or the
``isa`` option). Only when no shipped library fits (none for this machine or level, or
an editable install whose C files changed since) is the level built at first use with
the system C compiler (``$CC``, else ``cc``, ~1 s) into ``<cache>/kernels/`` under a
name made of the level, the sources, the compiler and the flags, which later processes
only load. There is no torch header in either build, hence no torch ABI to match and
no minute-long C++ compile: the library takes raw pointers through ``ctypes``.

When no library fits and no compiler is found, a build fails, or ``QUIRE_CPU_NATIVE=0``
is set, the platform logs why once and keeps the torch path (several times slower
decode steps, the warning says); results agree either way to float32 rounding.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from pathlib import Path
from typing import Any

import torch

from quire.ops import kv_quant
from quire.platforms.cpu import kernel_build
from quire.platforms.cpu.compact import CompactWeight
from quire.platforms.cpu.isa import IsaLevel, best_level, detect, levels_for
from quire.quantization.tensor import QuantizedTensor

logger = logging.getLogger(__name__)

#: ``0`` turns the native kernels off (torch ops only).
NATIVE_ENV = "QUIRE_CPU_NATIVE"

_i64 = ctypes.c_int64
_ptr = ctypes.c_void_p


class LinearArgs(ctypes.Structure):
    """``struct quire_linear`` of ``csrc/decode_layer.c``: a compact weight's pointers.

    Holds raw pointers: whoever builds one keeps the tensors it points into alive.
    """

    _fields_ = [("format", ctypes.c_int32), ("out_features", _i64), ("in_features", _i64),
                ("codes", _ptr), ("scales", _ptr), ("offsets", _ptr), ("bias", _ptr),
                ("num_parts", _i64)]

    #: ``format`` of a weight given as float32 panels (:meth:`NativeKernels.pack_panels`)
    #: rather than a compact encoding; a layer may mix the two.
    PANELS = 3
    #: ``format`` of a quantised weight (:mod:`quire.quantization`): ``codes`` points to
    #: ``num_parts`` :class:`QPartArgs`, the parts in output order.
    QUANT = 4

    @classmethod
    def of_parts(cls, parts: list[QuantizedTensor], bias: torch.Tensor | None,
                 acts: list[int] | None = None) -> LinearArgs:
        """A quantised weight's parts (host tensors), ``acts`` each one's decode rows'
        activations (:class:`QPartArgs`); the struct keeps its part array alive, the
        caller the parts."""
        array = QPartArgs.array(parts, acts)
        args = cls(cls.QUANT, sum(p.rows for p in parts), parts[0].cols,
                   ctypes.cast(array, ctypes.c_void_p), None, None,
                   bias.data_ptr() if bias is not None else None, len(parts))
        args._parts = array
        return args

    @classmethod
    def of(cls, weight: CompactWeight, bias: torch.Tensor | None) -> LinearArgs:
        return cls(weight.format_id, weight.out_features, weight.in_features,
                   weight.codes.data_ptr(), weight.scales.data_ptr(),
                   weight.offsets.data_ptr() if weight.offsets.numel() else None,
                   bias.data_ptr() if bias is not None else None)

    @classmethod
    def of_panels(cls, panels: torch.Tensor, out_features: int,
                  bias: torch.Tensor | None) -> LinearArgs:
        return cls(cls.PANELS, out_features, panels.shape[1], panels.data_ptr(), None, None,
                   bias.data_ptr() if bias is not None else None)


class QPartArgs(ctypes.Structure):
    """``struct quire_qpart`` of ``csrc/decode_layer.c``: one part of a quantised weight
    (a :class:`~quire.quantization.tensor.QuantizedTensor` on the host). Holds raw
    pointers, as :class:`LinearArgs` does."""

    _fields_ = [("fmt", ctypes.c_int32), ("rows", _i64), ("w", _ptr), ("w_stride", _i64),
                ("scales", _ptr), ("acts", ctypes.c_int32)]

    #: ``acts``: the direct path's (decode rows') activations: float32; int8 per 32
    #: values (``csrc/quant_q8.c``); rounded to bfloat16 (``quire_quant_rows_bf16_team``).
    #: The caller checked that the kernel fits the part
    #: (:meth:`NativeKernels.quant_q8_fits`, :meth:`NativeKernels.quant_rows_bf16_fits`).
    F32, Q8, BF16 = 0, 1, 2

    @classmethod
    def of(cls, part: QuantizedTensor, acts: int = F32) -> QPartArgs:
        return cls(part.format.id, part.rows, part.data.data_ptr(), part.data.stride(0),
                   None if part.scale is None else part.scale.data_ptr(), acts)

    @classmethod
    def array(cls, parts: list[QuantizedTensor], acts: list[int] | None = None
              ) -> ctypes.Array:
        """A layer's parts in output order, ``acts`` each one's activations (float32 by
        default); the caller keeps the array and the parts alive."""
        acts = acts or [cls.F32] * len(parts)
        return (cls * len(parts))(*(cls.of(p, a) for p, a in zip(parts, acts)))


class PanelArgs(ctypes.Structure):
    """``struct quire_panels`` of ``csrc/decode_layer.c``: a float32 weight packed by
    :meth:`NativeKernels.pack_panels`. Holds raw pointers, as :class:`LinearArgs` does."""

    _fields_ = [("out_features", _i64), ("in_features", _i64), ("panels", _ptr),
                ("bias", _ptr), ("bf16", ctypes.c_int32)]

    @classmethod
    def of(cls, panels: torch.Tensor, out_features: int, bias: torch.Tensor | None,
           in_features: int | None = None) -> PanelArgs:
        """float32 panels (:meth:`NativeKernels.pack_panels`), or bfloat16 pair panels
        (:meth:`NativeKernels.pack_bf16_panels`, which need ``in_features``)."""
        bf16 = panels.dtype == torch.bfloat16
        return cls(out_features, in_features if bf16 else panels.shape[1], panels.data_ptr(),
                   bias.data_ptr() if bias is not None else None, bf16)


class LayerDescArgs(ctypes.Structure):
    """``struct quire_layer_desc`` of ``csrc/decode_layer.c``: which norms a decoder layer
    has (NULL: absent; offsets already added to the weights), its activation, and
    whether its MLP runs outside (mixture of experts), and what its KV pages hold
    (``kv_type``, :data:`KV_TYPES`, set for each step: the pages' dtype is the engine's
    ``kv_cache_dtype``). Holds raw pointers, as :class:`LinearArgs` does."""

    _fields_ = [("eps", ctypes.c_float), ("activation", ctypes.c_int32),
                ("norm_in", _ptr), ("norm_pre_mlp", _ptr), ("q_norm", _ptr),
                ("k_norm", _ptr), ("attn_out_norm", _ptr), ("mlp_out_norm", _ptr),
                ("mlp_external", ctypes.c_int32), ("kv_type", ctypes.c_int32)]

    #: ``activation`` values, by the name a layer description uses.
    ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}


class StackLayerArgs(ctypes.Structure):
    """``struct quire_stack_layer`` of ``csrc/decode_layer.c``: one layer of a
    ``quire_decode_stack_f32`` call, its description, weights (:class:`LinearArgs`), KV
    page halves, attention window and scale. Holds raw pointers, as :class:`LinearArgs`
    does."""

    _fields_ = [("desc", ctypes.POINTER(LayerDescArgs)),
                ("qkv", ctypes.POINTER(LinearArgs)), ("o", ctypes.POINTER(LinearArgs)),
                ("gate_up", ctypes.POINTER(LinearArgs)), ("down", ctypes.POINTER(LinearArgs)),
                ("k_cache", _ptr), ("v_cache", _ptr), ("window", _i64),
                ("scale", ctypes.c_float)]


class RowsArgs(ctypes.Structure):
    """``struct quire_rows`` of ``csrc/decode_layer.c``: one step of a layer whose
    products run outside the C pieces (oneDNN, pair panels or the quantised op), the
    shapes and the rows between the products (the model's dtype, ``rows_f32`` saying
    which, but ``stream``, the float32 residual stream); the KV pages' dtype is its
    ``desc``'s ``kv_type``. Every ``quire_rows_*`` entry point takes it. Holds raw
    pointers, as :class:`LinearArgs` does."""

    _fields_ = [("rows", _i64), ("hidden", _i64), ("hq", _i64), ("hkv", _i64), ("d", _i64),
                ("desc", ctypes.POINTER(LayerDescArgs)), ("x", _ptr), ("residual", _ptr),
                ("stream", _ptr), ("normed", _ptr), ("qkv", _ptr), ("cos", _ptr),
                ("sin", _ptr), ("rot_stride", _i64), ("rot_bf16", ctypes.c_int32),
                ("k_cache", _ptr), ("v_cache", _ptr), ("slots", _ptr), ("tables", _ptr),
                ("seq_lens", _ptr), ("table_stride", _i64), ("block_size", _i64),
                ("window", _i64), ("scale", ctypes.c_float), ("attn", _ptr),
                ("o_out", _ptr), ("gate_up", _ptr), ("inter", _i64), ("act", _ptr),
                ("out", _ptr), ("residual_out", _ptr), ("rows_f32", ctypes.c_int32)]


#: What the C kernels call each KV page dtype (``QUIRE_KV_*`` of ``csrc/cpu_kernels.h``):
#: float32 and bfloat16 pages, and int8 and fp8 ones with a float16 scale per 16 values
#: (:mod:`quire.ops.kv_quant`).
KV_TYPES: dict[torch.dtype, int] = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2,
                                    torch.float8_e4m3fn: 3}


def pages_fit(kv_cache: torch.Tensor, hkv: int, d: int) -> bool:
    """Whether a layer's KV tensor is one the C kernels read and write in place: a dtype
    of :data:`KV_TYPES`, contiguous, on the host, with ``hkv`` heads of ``d`` (quantised:
    rows of ``d + d / 8``)."""
    return (kv_cache.dtype in KV_TYPES and kv_cache.device.type == "cpu"
            and kv_cache.dim() == 5 and kv_cache.is_contiguous()
            and kv_cache.shape[3:] == (hkv, kv_quant.row_size(d, kv_cache.dtype))
            and (not kv_quant.is_quantized(kv_cache) or d % kv_quant.GROUP == 0))


def _bound_per_quantized_dtype(entry: Any) -> dict[torch.dtype, Any]:
    """An entry point that takes the pages' :data:`KV_TYPES` number first, bound to it for
    each quantised page dtype (once, not per call)."""
    return {dtype: functools.partial(entry, number) for dtype, number in KV_TYPES.items()
            if kv_quant.is_quantized(dtype)}


def _twins(library: ctypes.CDLL, stem: str, argtypes: list) -> dict[torch.dtype, Any]:
    """An entry point's float32 and bfloat16 builds (``<stem>_f32``, ``<stem>_bf16``) by
    dtype, typed: each takes ``argtypes`` and returns 0 or an error code."""
    entries = {torch.float32: getattr(library, f"{stem}_f32"),
               torch.bfloat16: getattr(library, f"{stem}_bf16")}
    for entry in entries.values():
        entry.restype = ctypes.c_int
        entry.argtypes = argtypes
    return entries


class NativeKernels:
    """The loaded library's entry points, with their argument checks."""

    def __init__(self, library: ctypes.CDLL, path: Path, level: str) -> None:
        self.path = path
        #: the ISA level this library was built for (:mod:`~quire.platforms.cpu.isa`)
        self.level = level
        # by the KV cache's dtype: float32 pages, or bfloat16 ones read widened
        self._decode = _twins(library, "quire_paged_decode", [
            _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _i64, ctypes.c_float,
            _i64, _ptr])
        # int8 and fp8 pages: one entry taking their KV_TYPES number first, bound per dtype
        decode_quant = library.quire_paged_decode_quant
        decode_quant.restype = ctypes.c_int
        decode_quant.argtypes = [ctypes.c_int32, *self._decode[torch.float32].argtypes]
        self._decode.update(_bound_per_quantized_dtype(decode_quant))
        self._prompt = _twins(library, "quire_prompt_attention", [
            _ptr, _ptr, _ptr, _i64, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, ctypes.c_float,
            _i64, _ptr])
        self._chunk = _twins(library, "quire_chunk_attention", [
            _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64,
            ctypes.c_float, _i64, _ptr])
        # float32 rows over bfloat16 pages (absent from older builds)
        self._chunk_mixed = getattr(library, "quire_chunk_attention_f32_bf16kv", None)
        if self._chunk_mixed is not None:
            self._chunk_mixed.restype = ctypes.c_int
            self._chunk_mixed.argtypes = self._chunk[torch.float32].argtypes
        # float32 keys and values quantised into int8 or fp8 pages
        self._write_quant = library.quire_write_kv_quant
        self._write_quant.restype = ctypes.c_int
        self._write_quant.argtypes = [ctypes.c_int32, _ptr, _ptr, _ptr, _i64, _i64, _i64,
                                      _ptr, _i64, _ptr, _i64]
        # float32 rows over int8 or fp8 pages, bound per dtype as the decode entry
        chunk_quant = library.quire_chunk_attention_quant
        chunk_quant.restype = ctypes.c_int
        chunk_quant.argtypes = [ctypes.c_int32, *self._chunk[torch.float32].argtypes]
        self._chunk_quant = _bound_per_quantized_dtype(chunk_quant)
        self._gemv = library.quire_compact_gemv
        self._gemv.restype = ctypes.c_int
        self._gemv.argtypes = [ctypes.c_int32, _ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr,
                               _ptr]
        # Raw: quire/platforms/cpu/fused_decode.py builds its arguments once per layer and
        # calls it every step, where a checking wrapper would cost more than the call.
        self.decode_layer_f32 = library.quire_decode_layer_f32
        self.decode_layer_f32.restype = ctypes.c_int
        linear = ctypes.POINTER(LinearArgs)
        desc = ctypes.POINTER(LayerDescArgs)
        self.decode_layer_f32.argtypes = [
            _ptr, _ptr, _i64, desc, linear, linear, linear, linear,
            _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _i64, _i64,
            ctypes.c_float, _ptr, _ptr]
        # the last rows of one sequence (speculative decoding's verification), as raw
        self.decode_rows_f32 = library.quire_decode_rows_f32
        self.decode_rows_f32.restype = ctypes.c_int
        self.decode_rows_f32.argtypes = [
            _i64, _ptr, _ptr, _i64, desc, linear, linear, linear, linear,
            _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64,
            ctypes.c_float, _ptr, _ptr]
        # consecutive layers of one sequence's step in one call (fused_stack.py), as raw
        self.decode_stack_f32 = library.quire_decode_stack_f32
        self.decode_stack_f32.restype = ctypes.c_int
        self.decode_stack_f32.argtypes = [
            _i64, _ptr, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _i64,
            _i64, _i64, _i64, _ptr, _ptr]
        # a decode batch through consecutive layers on quantised weights (fused_stack.py)
        self.rows_stack_f32 = library.quire_rows_stack_f32
        self.rows_stack_f32.restype = ctypes.c_int
        self.rows_stack_f32.argtypes = [
            _i64, _ptr, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _ptr,
            _i64, _i64, _i64, _i64, ctypes.c_int32, _ptr, _ptr]
        # Raw too, for the same reason: quire/platforms/cpu/fused_decode.py's decode batches.
        self.decode_batch_f32 = library.quire_decode_batch_f32
        self.decode_batch_f32.restype = ctypes.c_int
        panel = ctypes.POINTER(PanelArgs)
        self.decode_batch_f32.argtypes = [
            _i64, _ptr, _ptr, _i64, desc, panel, panel, panel, panel,
            _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _i64, _i64, _i64, _i64,
            _i64, ctypes.c_float, _ptr, _ptr]
        # the same for a bfloat16 model: bfloat16 rows in and out, float32 inside
        self.decode_batch_bf16 = library.quire_decode_batch_bf16
        self.decode_batch_bf16.restype = ctypes.c_int
        self.decode_batch_bf16.argtypes = self.decode_batch_f32.argtypes
        self.layer_front_f32 = library.quire_layer_front_f32
        self.layer_front_f32.restype = ctypes.c_int
        self.layer_front_f32.argtypes = [
            _i64, _ptr, _ptr, _i64, desc, panel, _ptr, _ptr, _i64, _i64, _i64, _i64, _ptr,
            _ptr]
        self.layer_back_f32 = library.quire_layer_back_f32
        self.layer_back_f32.restype = ctypes.c_int
        self.layer_back_f32.argtypes = [
            _i64, _ptr, _i64, _ptr, desc, panel, panel, panel, _ptr]
        # Raw as well: a layer's steps between its products, each taking a pointer to
        # one RowsArgs (fused_decode.py's FusedDecodeLayer._rows_step).
        rows = ctypes.POINTER(RowsArgs)
        for name in ("front", "attend", "rotate", "post_attn", "act", "out_norm"):
            entry = getattr(library, f"quire_rows_{name}")
            entry.restype = ctypes.c_int
            entry.argtypes = [rows]
            setattr(self, f"rows_{name}", entry)
        self._panel = library.quire_panel_gemm_f32
        self._panel.restype = ctypes.c_int
        self._panel.argtypes = [_ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr]
        #: whether this build has the panel GEMM (it needs AVX2 and FMA)
        self.has_panel_gemm = bool(library.quire_panel_gemm_available())
        self._bf16_linear = library.quire_bf16_linear
        self._bf16_linear.restype = ctypes.c_int
        self._bf16_linear.argtypes = [_ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr, ctypes.c_int32]
        #: whether this build has the bfloat16 pair-panel GEMM (it needs AVX512_BF16)
        self.has_bf16_gemm = bool(library.quire_bf16_gemm_available())
        self._norm = library.quire_rms_norm_f32
        self._norm.restype = ctypes.c_int
        self._norm.argtypes = [_ptr, _ptr, _ptr, ctypes.c_float, _i64, _i64, _ptr, _ptr]
        # quant_gemm.c: products on quantised weights read in place (a library built
        # before it existed lacks them: then has_quant_gemm is False)
        self._quant_f32 = getattr(library, "quire_quant_gemm_f32", None)
        self._quant_i8 = getattr(library, "quire_quant_gemm_i8", None)
        #: whether this build has the quantised-weight products (every ISA level does)
        self.has_quant_gemm = self._quant_f32 is not None and self._quant_i8 is not None
        if self.has_quant_gemm:
            self._quant_f32.restype = ctypes.c_int
            self._quant_f32.argtypes = [ctypes.c_int32, _ptr, _i64, _i64, _ptr, _i64, _i64,
                                        _ptr, _ptr, _ptr, _i64]
            self._quant_i8.restype = ctypes.c_int
            self._quant_i8.argtypes = [_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr, _ptr,
                                       _i64]
        # quant_gemm.c's bfloat16 path (levels with AVX512_BF16; absent from older builds)
        self._quant_bf16 = getattr(library, "quire_quant_gemm_bf16", None)
        # the same for float32 rows, rounded in the call (absent from older builds)
        self._quant_bf16_f32 = getattr(library, "quire_quant_gemm_bf16_f32", None)
        available = getattr(library, "quire_quant_gemm_bf16_available", None)
        #: whether this build multiplies bfloat16 rows by quantised weights (AVX512_BF16)
        self.has_quant_bf16 = (self._quant_bf16 is not None and available is not None
                               and bool(available()))
        ready = getattr(library, "quire_amx_ready", None)
        #: whether the bfloat16 products on quantised weights run on AMX tiles: the amx
        #: level's build, once Linux granted this process the tile state (amx_tiles.c)
        self.has_amx = ready is not None and bool(ready())
        self._amx_sections = getattr(library, "quire_amx_sections", None)
        if self._amx_sections is not None:
            self._amx_sections.restype = ctypes.c_uint64
            self._amx_sections.argtypes = []
        for entry in (self._quant_bf16, self._quant_bf16_f32):
            if entry is not None:
                entry.restype = ctypes.c_int
                entry.argtypes = [ctypes.c_int32, _ptr, _i64, _i64, _ptr, _i64, _i64, _ptr,
                                  _ptr, _ptr, _i64]
        # a layer's parts in one call (absent from older builds)
        self._quant_bf16_parts = getattr(library, "quire_quant_gemm_bf16_parts", None)
        if self._quant_bf16_parts is not None:
            self._quant_bf16_parts.restype = ctypes.c_int
            self._quant_bf16_parts.argtypes = [_i64, _ptr, _ptr, ctypes.c_int32, _i64, _i64,
                                               _ptr, _i64]
        # quant_q8.c: the same products with the activations quantised to int8 per 32
        # values (integer dot products); absent from a library built before it
        self._quant_q8 = getattr(library, "quire_quant_gemm_q8", None)
        self._quant_q8_fits = getattr(library, "quire_quant_q8_fits", None)
        self._quant_q8_team_test = getattr(library, "quire_quant_rows_q8_team_test", None)
        #: whether this build has the int8-activation products (every ISA level does)
        self.has_quant_q8 = self._quant_q8 is not None and self._quant_q8_fits is not None
        if self.has_quant_q8:
            self._quant_q8.restype = ctypes.c_int
            self._quant_q8.argtypes = [ctypes.c_int32, _ptr, _i64, _i64, _ptr, _i64, _i64,
                                       _ptr, _ptr, _i64]
            self._quant_q8_fits.restype = ctypes.c_int
            self._quant_q8_fits.argtypes = [ctypes.c_int32, _i64]
        self._quant_q8_batch = getattr(library, "quire_quant_gemm_q8_batch", None)
        batch = getattr(library, "quire_quant_q8_batch_available", None)
        #: whether this build has the int8-activation batch kernel (AVX2 and above)
        self.has_quant_q8_batch = (self.has_quant_q8 and self._quant_q8_batch is not None
                                   and batch is not None and bool(batch()))
        if self._quant_q8_batch is not None:
            self._quant_q8_batch.restype = ctypes.c_int
            self._quant_q8_batch.argtypes = self._quant_q8.argtypes
        # quant_gemm.c: the direct path with the rows rounded to bfloat16 (Q4_0 to Q5_1
        # and the K-quants Q4_K to Q6_K at the levels with AVX512_BF16;
        # quire_quant_rows_bf16_fits says which)
        self._quant_rows_bf16 = getattr(library, "quire_quant_rows_bf16", None)
        self._quant_rows_bf16_fits = getattr(library, "quire_quant_rows_bf16_fits", None)
        if self._quant_rows_bf16 is not None and self._quant_rows_bf16_fits is not None:
            self._quant_rows_bf16.restype = ctypes.c_int
            self._quant_rows_bf16.argtypes = self._quant_q8.argtypes
            self._quant_rows_bf16_fits.restype = ctypes.c_int
            self._quant_rows_bf16_fits.argtypes = [ctypes.c_int32, _i64]
        if self._quant_q8_team_test is not None:
            self._quant_q8_team_test.restype = ctypes.c_int
            self._quant_q8_team_test.argtypes = [ctypes.c_int32, _ptr, _i64, _i64, _ptr, _i64,
                                                 _i64, _ptr, _ptr, _i64, ctypes.c_int32]

    def amx_sections(self) -> int:
        """How many threads' AMX tile sections the products have begun in this process
        (0 at levels without AMX): the tiles' results equal the vector paths' bit for bit
        where they are exact, so this is how a caller tells which of the two ran."""
        return int(self._amx_sections()) if self._amx_sections is not None else 0

    @staticmethod
    def pack_panels(weight: torch.Tensor) -> torch.Tensor:
        """A float32 ``[N, K]`` weight as the panels :meth:`panel_linear` reads:
        ``[ceil(N / 16), K, 16]``, panel ``p`` holding columns ``16p .. 16p + 15`` (zero
        past N)."""
        n, k = weight.shape
        panels = -(-n // 16)
        padded = weight.new_zeros(panels * 16, k)
        padded[:n] = weight
        return padded.view(panels, 16, k).transpose(1, 2).contiguous()

    def panel_linear(self, x: torch.Tensor, panels: torch.Tensor, out_features: int,
                     bias: torch.Tensor | None) -> torch.Tensor | None:
        """``x @ W.T + bias`` for float32 ``x`` ``[rows, K]`` and ``W`` packed by
        :meth:`pack_panels`; None when the build has no panel kernel or the inputs do
        not fit it."""
        if not (self.has_panel_gemm and x.dtype == torch.float32 and x.device.type == "cpu"
                and x.dim() == 2 and panels.dim() == 3 and x.shape[1] == panels.shape[1]
                and panels.shape[0] * 16 >= out_features
                and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()))):
            return None
        x = x.contiguous()
        y = torch.empty(x.shape[0], out_features, dtype=torch.float32)
        failed = self._panel(x.data_ptr(), x.shape[0], x.shape[1], panels.data_ptr(),
                             out_features, None if bias is None else bias.data_ptr(),
                             y.data_ptr())
        return None if failed else y

    @staticmethod
    def pack_bf16_panels(weight: torch.Tensor) -> torch.Tensor:
        """A bfloat16 ``[N, K]`` weight as the pair panels :meth:`bf16_linear` reads:
        ``[ceil(N / 16), ceil(K / 2), 16, 2]``, panel ``p`` holding columns ``16p ..
        16p + 15``, two K steps per column side by side (zero past N and K)."""
        n, k = weight.shape
        panels, k2 = -(-n // 16), -(-k // 2)
        padded = weight.new_zeros(panels * 16, 2 * k2)
        padded[:n, :k] = weight
        return padded.view(panels, 16, k2, 2).transpose(1, 2).contiguous()

    @staticmethod
    def unpack_bf16_panels(panels: torch.Tensor, out_features: int,
                           in_features: int) -> torch.Tensor:
        """The ``[N, K]`` weight :meth:`pack_bf16_panels` packed."""
        n_pad = panels.shape[0] * 16
        flat = panels.transpose(1, 2).reshape(n_pad, -1)
        return flat[:out_features, :in_features].contiguous()

    def bf16_linear(self, x: torch.Tensor, panels: torch.Tensor, out_features: int,
                    bias: torch.Tensor | None,
                    out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor | None:
        """``x @ W.T + bias`` for bfloat16 ``x`` ``[rows, K]`` and ``W`` packed by
        :meth:`pack_bf16_panels`, summed in float32 and returned in ``out_dtype``
        (bfloat16 or float32); None when the build has no bfloat16 kernel or the inputs
        do not fit it."""
        if not (self.has_bf16_gemm and x.dtype == torch.bfloat16 and x.device.type == "cpu"
                and x.dim() == 2 and x.shape[0] > 0 and panels.dtype == torch.bfloat16
                and panels.dim() == 4 and panels.shape[1] == -(-x.shape[1] // 2)
                and panels.shape[0] * 16 >= out_features
                and (bias is None or bias.shape == (out_features,))
                and out_dtype in (torch.bfloat16, torch.float32)):
            return None
        x = x.contiguous()
        if bias is not None:
            bias = bias.to(torch.float32).contiguous()
        y = torch.empty(x.shape[0], out_features, dtype=out_dtype)
        failed = self._bf16_linear(x.data_ptr(), x.shape[0], x.shape[1], panels.data_ptr(),
                                   out_features, None if bias is None else bias.data_ptr(),
                                   y.data_ptr(), out_dtype == torch.bfloat16)
        return None if failed else y

    #: quant_gemm.c's return codes that mean the arguments are wrong (not a fallback)
    _QUANT_ERRORS = {1: "unknown weight format", 2: "a row is not a whole number of blocks"}
    #: most columns quant_linear_i8 takes (int32 sums of larger rows could overflow)
    QUANT_I8_MAX_K = 65536

    def _quant_args(self, x: torch.Tensor, weight: QuantizedTensor, bias: torch.Tensor | None,
                    out: torch.Tensor | None, rows_dtype: torch.dtype = torch.float32
                    ) -> torch.Tensor | None:
        """The output of a quantised product, when the arguments fit the kernels (host
        rows ``[m, cols]`` of ``rows_dtype``, a host weight with contiguous rows, a float32
        bias of ``rows``, ``out`` float32 ``[m, rows]`` with contiguous rows); else None."""
        data = weight.data
        m, n = x.shape[0] if x.dim() == 2 else -1, weight.rows
        if not (self.has_quant_gemm and x.dim() == 2 and x.dtype == rows_dtype
                and x.device.type == "cpu" and x.is_contiguous() and x.shape[1] == weight.cols
                and data.device.type == "cpu" and (data.shape[1] <= 1 or data.stride(1) == 1)
                and (weight.scale is None or weight.scale.is_contiguous())
                and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()
                                      and bias.shape == (n,) and bias.device.type == "cpu"))):
            return None
        if out is None:
            return torch.empty(m, n, dtype=torch.float32)
        if not (out.dtype == torch.float32 and out.device.type == "cpu" and out.dim() == 2
                and tuple(out.shape) == (m, n) and (n <= 1 or out.stride(1) == 1)):
            return None
        return out

    def _quant_call(self, entry: Any, head: tuple, x: torch.Tensor, weight: QuantizedTensor,
                    bias: torch.Tensor | None, y: torch.Tensor) -> torch.Tensor | None:
        data = weight.data
        failed = entry(*head, x.data_ptr(), x.shape[0], x.shape[1], data.data_ptr(),
                       data.stride(0) if data.shape[0] > 1 else data.shape[1], weight.rows,
                       None if weight.scale is None else weight.scale.data_ptr(),
                       None if bias is None else bias.data_ptr(), y.data_ptr(),
                       y.stride(0) if y.shape[0] > 1 else weight.rows)
        if failed in self._QUANT_ERRORS:
            raise ValueError(f"quant_gemm: {weight.format.name} (id {weight.format.id}), "
                             f"{weight.cols} columns: {self._QUANT_ERRORS[failed]}")
        return None if failed else y

    def quant_linear(self, x: torch.Tensor, weight: QuantizedTensor,
                     bias: torch.Tensor | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor | None:
        """``x @ W.T + bias`` for float32 ``x`` ``[m, cols]`` and a quantised ``W`` read
        in place (its rows may be strided: a column slice), float32 sums of the weights
        dequantised exactly as :mod:`quire.quantization.dequant` does.

        :param out: where to write (float32 ``[m, rows]``, rows any distance apart: a
            slice of a wider output); a new tensor when None.
        :returns: ``out`` (or the new tensor); None when the arguments do not fit the
            kernel or it could not allocate its scratch (the caller uses torch).
        :raises ValueError: when the kernel does not know the format or the columns are
            not whole blocks.
        """
        y = self._quant_args(x, weight, bias, out)
        if y is None:
            return None
        return self._quant_call(self._quant_f32, (weight.format.id,), x, weight, bias, y)

    def quant_linear_i8(self, x: torch.Tensor, weight: QuantizedTensor,
                        bias: torch.Tensor | None = None,
                        out: torch.Tensor | None = None) -> torch.Tensor | None:
        """``w8a8``: float32 ``x`` ``[m, cols]`` quantised per row to int8 (as
        :func:`quire.ops.quantized.quantize_activations`) times an ``int8`` weight,
        exact integer sums scaled as :func:`quire.ops.quantized.quantized_linear` does.

        :returns: as :meth:`quant_linear`; None also for another format or more than
            :data:`QUANT_I8_MAX_K` columns.
        """
        if weight.format.name != "int8" or weight.cols > self.QUANT_I8_MAX_K:
            return None
        y = self._quant_args(x, weight, bias, out)
        if y is None:
            return None
        return self._quant_call(self._quant_i8, (), x, weight, bias, y)

    def quant_linear_bf16(self, x: torch.Tensor, weight: QuantizedTensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor | None:
        """``x @ W.T + bias`` for bfloat16 ``x`` ``[m, cols]``, or float32 ``x`` rounded to
        bfloat16 (nearest even, as torch) in the call, and a quantised ``W`` read in
        place: each weight dequantised as :mod:`quire.quantization.dequant` does, rounded
        to bfloat16, and summed in float32 (``csrc/quant_gemm.c``, AVX512_BF16 only; on
        AMX tiles where :attr:`has_amx`).

        :returns: float32 ``[m, rows]``; None when the build has no such path, the
            arguments do not fit it (odd ``cols``) or scratch could not be had.
        :raises ValueError: as :meth:`quant_linear`.
        """
        entry = {torch.bfloat16: self._quant_bf16,
                 torch.float32: self._quant_bf16_f32}.get(x.dtype)
        if not (self.has_quant_bf16 and entry is not None and x.dim() == 2
                and x.device.type == "cpu" and x.is_contiguous()):
            return None
        y = self._quant_args(x, weight, bias, None, rows_dtype=x.dtype)
        if y is None:
            return None
        return self._quant_call(entry, (weight.format.id,), x, weight, bias, y)

    def quant_parts_bf16(self, x: torch.Tensor, parts: ctypes.Array,
                         out_features: int) -> torch.Tensor | None:
        """:meth:`quant_linear_bf16` for a layer's parts in one call (``parts``: its
        :class:`QPartArgs` in output order, ``out_features`` their rows in all; the
        caller keeps the parts alive): float32 ``[m, out_features]``, each part's
        columns what :meth:`quant_linear_bf16` gives for it alone, no bias. None where
        :meth:`quant_linear_bf16` would be (no such path, odd columns, no scratch).
        """
        if not (self.has_quant_bf16 and self._quant_bf16_parts is not None
                and x.dtype in (torch.float32, torch.bfloat16) and x.dim() == 2
                and x.device.type == "cpu" and x.is_contiguous()):
            return None
        m = x.shape[0]
        y = torch.empty(m, out_features, dtype=torch.float32)
        failed = self._quant_bf16_parts(len(parts), ctypes.addressof(parts), x.data_ptr(),
                                        x.dtype == torch.float32, m, x.shape[1],
                                        y.data_ptr(), out_features)
        if failed in (1, 2):
            raise ValueError(f"quant_gemm: a part does not fit {x.shape[1]} columns: "
                             f"{self._QUANT_ERRORS[failed]}")
        return None if failed else y

    #: quire_quant_gemm_q8's code for a format it does not take (the caller falls back)
    QUANT_Q8_UNSUPPORTED = 4

    def quant_q8_fits(self, weight: QuantizedTensor) -> bool:
        """Whether :meth:`quant_linear_q8` takes ``weight``'s format and width."""
        return self.has_quant_q8 and bool(self._quant_q8_fits(weight.format.id, weight.cols))

    def quant_linear_q8(self, x: torch.Tensor, weight: QuantizedTensor,
                        bias: torch.Tensor | None = None,
                        out: torch.Tensor | None = None, *,
                        team_threads: int | None = None,
                        batch: bool = False) -> torch.Tensor | None:
        """``q8(x) @ W.T + bias``: float32 ``x`` ``[m, cols]`` quantised to int8 per 32
        values (``d = max|x| / 127``, round half to even), integer dot products with a
        GGUF block weight's codes read in place (rows may be strided), the block scales
        and minima applied in float (``csrc/quant_q8.c``).

        :param team_threads: run the team variant (``quire_quant_rows_q8_team``) in a
            team of this many threads instead of the one-call entry (for tests).
        :param batch: the batch kernel (``quire_quant_gemm_q8_batch``: the weight unpacked
            once into column panels, for many rows) instead of the tiles of up to four
            rows; None where the build lacks it (:attr:`has_quant_q8_batch`).
        :returns: ``out`` (or a new tensor); None when the format or shape does not fit
            (the caller uses :meth:`quant_linear` or torch) or without scratch memory.
        """
        if not self.has_quant_q8 or not self._quant_q8_fits(weight.format.id, weight.cols):
            return None
        y = self._quant_args(x, weight, bias, out)
        if y is None:
            return None
        data = weight.data
        args = (weight.format.id, x.data_ptr(), x.shape[0], x.shape[1], data.data_ptr(),
                data.stride(0) if data.shape[0] > 1 else data.shape[1], weight.rows,
                None if bias is None else bias.data_ptr(), y.data_ptr(),
                y.stride(0) if y.shape[0] > 1 else weight.rows)
        if batch:
            if not self.has_quant_q8_batch:
                return None
            failed = self._quant_q8_batch(*args)
        elif team_threads is not None:
            if self._quant_q8_team_test is None:
                return None
            failed = self._quant_q8_team_test(*args, team_threads)
        else:
            failed = self._quant_q8(*args)
        return None if failed else y

    def quant_rows_bf16_fits(self, weight: QuantizedTensor) -> bool:
        """Whether :meth:`quant_rows_bf16` takes ``weight``'s format and width."""
        return (self._quant_rows_bf16_fits is not None
                and bool(self._quant_rows_bf16_fits(weight.format.id, weight.cols)))

    def quant_rows_bf16(self, x: torch.Tensor, weight: QuantizedTensor,
                        bias: torch.Tensor | None = None) -> torch.Tensor | None:
        """``x @ W.T + bias`` for float32 ``x`` ``[m, cols]`` (few rows: the direct
        path, each block read once for every four) rounded to bfloat16 (nearest even, as
        torch rounds) in the call, times the exact weights read in place, float32 sums
        (``quire_quant_rows_bf16`` in ``csrc/quant_gemm.c``).

        :returns: a new tensor; None where :meth:`quant_rows_bf16_fits` says no or the
            arguments do not fit (the caller takes another kernel).
        """
        if not self.quant_rows_bf16_fits(weight):
            return None
        y = self._quant_args(x, weight, bias, None)
        if y is None:
            return None
        data = weight.data
        failed = self._quant_rows_bf16(
            weight.format.id, x.data_ptr(), x.shape[0], x.shape[1], data.data_ptr(),
            data.stride(0) if data.shape[0] > 1 else data.shape[1], weight.rows,
            None if bias is None else bias.data_ptr(), y.data_ptr(), weight.rows)
        return None if failed else y

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
        """``weight * (h / sqrt(mean(h^2) + eps))`` over the last dimension, where
        ``h = residual + x`` when a residual is given (else ``x``).

        :returns: the normalised tensor, and with ``residual`` also ``h`` (the new
            residual stream), as :class:`quire.models.layers.norm.RMSNorm` does; None when
            the inputs are not float32 host tensors of matching shapes.
        """
        n = weight.shape[-1] if weight.dim() == 1 else -1
        if not (x.dtype == weight.dtype == torch.float32 and x.device.type == "cpu"
                and weight.device.type == "cpu" and x.shape[-1] == n
                and weight.is_contiguous()
                and (residual is None or (residual.shape == x.shape
                                          and residual.dtype == torch.float32
                                          and residual.device.type == "cpu"))):
            return None
        x = x.contiguous()
        out = torch.empty_like(x)
        new_residual = None
        if residual is not None:
            residual = residual.contiguous()
            new_residual = torch.empty_like(x)
        failed = self._norm(
            x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
            eps, x.numel() // n, n, out.data_ptr(),
            None if new_residual is None else new_residual.data_ptr())
        if failed:
            return None
        return out if residual is None else (out, new_residual)

    def compact_linear(self, x: torch.Tensor, weight: CompactWeight,
                       bias: torch.Tensor | None) -> torch.Tensor | None:
        """``x @ W.T + bias`` for a few float32 rows and a :class:`CompactWeight` ``W``.

        Reads the weight once for all rows (each row of ``W`` is used by every row of
        ``x`` while it is in cache), so it pays off for a handful of rows.

        :param x: float32 ``[rows, in_features]`` on the host.
        :returns: float32 ``[rows, out_features]``, or None when the inputs are not what
            the kernel takes (the caller then uses its other path).
        """
        if not (x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2
                and x.shape[1] == weight.in_features
                and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()))):
            return None
        x = x.contiguous()
        y = torch.empty(x.shape[0], weight.out_features, dtype=torch.float32)
        failed = self._gemv(
            weight.format_id, x.data_ptr(), x.shape[0], weight.in_features,
            weight.out_features, weight.codes.data_ptr(), weight.scales.data_ptr(),
            weight.offsets.data_ptr() if weight.offsets.numel() else None,
            bias.data_ptr() if bias is not None else None, y.data_ptr())
        return None if failed else y

    def paged_decode(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        window: int | None,
    ) -> torch.Tensor | None:
        """Attention of one query token per sequence over its pages.

        :param query: [B, Hq, D], each sequence's newest token (float32; the cache's
            dtype; or bfloat16 or float16 over quantised pages: computed in float32 from
            the rows widened, and returned in the query's dtype).
        :param kv_cache: float32 or bfloat16 [2, num_blocks, block_size, Hkv, D], or
            int8 or fp8 [..., D + D / 8] (:mod:`quire.ops.kv_quant`), contiguous: bfloat16
            pages are read widened to float32 exactly, quantised ones with their scales.
        :param block_tables: int64 [B, max_blocks], contiguous rows.
        :param seq_lens: int64 [B]: the query sits at position ``seq_lens[i] - 1`` and
            reads positions ``0 .. seq_lens[i] - 1`` (the last ``window`` with a window).
        :returns: [B, Hq, D], or None when the inputs are not what the kernel takes
            (another dtype, device or layout) or it could not allocate scratch memory;
            the caller then uses the torch path.
        """
        quantized = kv_quant.is_quantized(kv_cache)
        b, hq, d = query.shape
        if not ((query.dtype == torch.float32
                 or (query.dtype == kv_cache.dtype and not quantized)
                 or (quantized and query.dtype in _WIDENED))
                and query.device.type == "cpu"
                and kv_cache.dim() == 5 and pages_fit(kv_cache, kv_cache.shape[3], d)
                and block_tables.dtype == seq_lens.dtype == torch.int64
                and block_tables.stride(1) == 1 and seq_lens.is_contiguous()
                and hq % kv_cache.shape[3] == 0 and block_tables.shape[0] == b
                and seq_lens.shape[0] == b):
            return None
        q = query.to(torch.float32).contiguous()
        _, _, block_size, hkv, _ = kv_cache.shape
        entry = self._decode[kv_cache.dtype]
        out = torch.empty_like(q)
        half = kv_cache[0].numel() * kv_cache.element_size()
        base = kv_cache.data_ptr()
        failed = entry(
            q.data_ptr(), base, base + half, block_tables.data_ptr(),
            block_tables.stride(0), seq_lens.data_ptr(), b, hq, hkv, d, block_size,
            scale, window or 0, out.data_ptr())
        return None if failed else out.to(query.dtype)

    def write_kv_quant(self, kv_cache: torch.Tensor, slots: torch.Tensor,
                       key: torch.Tensor, value: torch.Tensor) -> bool:
        """Quantise float32 ``key`` and ``value`` ``[T, Hkv, D]`` (rows of any stride,
        each row's heads contiguous) into their ``slots`` of int8 or fp8 pages, bit for
        bit as :func:`quire.ops.kv_quant.write_kv`. False (nothing written) when the
        inputs are not what the kernel takes."""
        t, hkv, d = key.shape
        if not (kv_quant.is_quantized(kv_cache) and pages_fit(kv_cache, hkv, d)
                and key.dtype == value.dtype == torch.float32 and key.shape == value.shape
                and key.device.type == value.device.type == "cpu"
                and key.stride()[1:] == (d, 1) and value.stride()[1:] == (d, 1)
                and slots.dtype == torch.int64 and slots.shape == (t,)
                and slots.is_contiguous()):
            return False
        base = kv_cache.data_ptr()
        return not self._write_quant(
            KV_TYPES[kv_cache.dtype], base, base + kv_cache[0].numel(), slots.data_ptr(), t,
            hkv, d, key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0))

    def prompt_attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        prompts: tuple[tuple[int, int], ...],
        scale: float,
        window: int | None,
    ) -> torch.Tensor | None:
        """Causal attention of whole prompts over their own keys and values.

        :param query: [T, Hq, D] float32 or bfloat16; rows may have any stride, each
            row's heads contiguous (a view into a fused q/k/v projection will do).
        :param key: [T, Hkv, D], as ``query``; ``value`` the same, with key's row stride.
        :param prompts: (first row, rows) of each prompt; positions 0 .. rows - 1.
        :param window: a sliding window (a row reads the last ``window`` positions), or
            None.
        :returns: the prompts' rows one after another, [sum of rows, Hq, D] in the
            query's dtype; None when the inputs are not what the kernel takes (another
            dtype or layout, an empty prompt) or it could not allocate scratch memory,
            so the caller uses the torch path.
        """
        entry = self._prompt.get(query.dtype)
        t, hq, d = query.shape
        if not (entry is not None and prompts and query.dtype == key.dtype == value.dtype
                and query.device.type == key.device.type == value.device.type == "cpu"
                and key.shape == value.shape and key.shape[0] == t and key.shape[2] == d
                and hq % key.shape[1] == 0 and key.stride() == value.stride()
                and query.stride()[1:] == (d, 1) and key.stride()[1:] == (d, 1)
                and all(n > 0 and 0 <= start and start + n <= t for start, n in prompts)):
            return None
        starts = torch.tensor([start for start, _ in prompts], dtype=torch.int64)
        lens = torch.tensor([n for _, n in prompts], dtype=torch.int64)
        out = query.new_empty(int(lens.sum()), hq, d)
        failed = entry(query.data_ptr(), key.data_ptr(), value.data_ptr(), query.stride(0),
                       key.stride(0), starts.data_ptr(), lens.data_ptr(), len(prompts), hq,
                       key.shape[1], d, scale, window or 0, out.data_ptr())
        return None if failed else out


    def chunk_attention(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        chunks: tuple[tuple[int, int], ...],
        seq_lens: torch.Tensor,
        scale: float,
        window: int | None,
    ) -> torch.Tensor | None:
        """Causal attention of chunks after a cached prefix over their sequences' pages
        (the chunks' own keys and values already written there).

        :param query: [T, Hq, D] in the cache's dtype (float32 or bfloat16), or float32
            over a bfloat16 cache (its pages widened) or an int8 or fp8 one (dequantised
            with their scales; bfloat16 or float16 rows there are widened to float32 and
            the result rounded back); rows may have any stride, each row's heads
            contiguous.
        :param kv_cache: [2, num_blocks, block_size, Hkv, D] (quantised: D + D / 8),
            contiguous.
        :param block_tables: int64 [B, width], contiguous rows; wide enough for
            ``seq_lens``.
        :param chunks: (first row, rows) of each sequence's new tokens in ``query``.
        :param seq_lens: int64 [B]: each sequence's length with its chunk, so its new
            tokens sit at positions ``seq_lens[i] - rows .. seq_lens[i] - 1``.
        :param window: a sliding window (a row reads the last ``window`` positions), or
            None.
        :returns: the chunks' rows one after another, [sum of rows, Hq, D] in the
            query's dtype; None when the inputs are not what the kernel takes, so the
            caller uses the torch path.
        """
        quantized = kv_quant.is_quantized(kv_cache)
        if quantized and query.dtype in _WIDENED:  # the kernel reads float32 rows
            out = self.chunk_attention(query.float(), kv_cache, block_tables, chunks,
                                       seq_lens, scale, window)
            return None if out is None else out.to(query.dtype)
        entry = (self._chunk.get(kv_cache.dtype) if query.dtype == kv_cache.dtype
                 else self._chunk_mixed
                 if (query.dtype, kv_cache.dtype) == (torch.float32, torch.bfloat16)
                 else self._chunk_quant.get(kv_cache.dtype)
                 if query.dtype == torch.float32 else None)
        if not (entry is not None and chunks and query.dim() == kv_cache.dim() - 2 == 3
                and query.device.type == kv_cache.device.type == "cpu"
                and kv_cache.is_contiguous() and block_tables.dtype == torch.int64
                and block_tables.stride(1) == 1 and seq_lens.dtype == torch.int64
                and seq_lens.is_contiguous() and len(chunks) == seq_lens.shape[0]
                == block_tables.shape[0]):
            return None
        t, hq, d = query.shape
        _, _, block_size, hkv, dk = kv_cache.shape
        lens = seq_lens.tolist()
        if not (dk == kv_quant.row_size(d, kv_cache.dtype) and hq % hkv == 0
                and (not quantized or d % kv_quant.GROUP == 0)
                and query.stride()[1:] == (d, 1)
                and max(lens) <= block_tables.shape[1] * block_size
                and all(0 < n <= length and 0 <= start and start + n <= t
                        for (start, n), length in zip(chunks, lens))):
            return None
        starts = torch.tensor([start for start, _ in chunks], dtype=torch.int64)
        rows = torch.tensor([n for _, n in chunks], dtype=torch.int64)
        out = query.new_empty(int(rows.sum()), hq, d)
        half = kv_cache[0].numel() * kv_cache.element_size()
        base = kv_cache.data_ptr()
        failed = entry(query.data_ptr(), query.stride(0), base, base + half,
                       block_tables.data_ptr(), block_tables.stride(0), block_size,
                       starts.data_ptr(), rows.data_ptr(), seq_lens.data_ptr(), len(chunks),
                       hq, hkv, d, scale, window or 0, out.data_ptr())
        return None if failed else out

#: Query dtypes the attention kernels widen to float32 over quantised pages, whose
#: kernels read float32 rows: exact, where the torch path would dequantise every page.
_WIDENED = (torch.bfloat16, torch.float16)


def load_native_kernels(cache_root: Path | None = None, enabled: bool | None = None,
                        isa: str | None = None,
                        prebuilt: Path | None = kernel_build.PREBUILT) -> NativeKernels | None:
    """Load the kernels of the best ISA level the running CPU has
    (:func:`~quire.platforms.cpu.isa.best_level`): the library the package build left
    for that level when it fits (:func:`~quire.platforms.cpu.kernel_build.find_prebuilt`),
    else one built here (once per level, source and compiler); failing both, the next
    lower level the same way.

    :param cache_root: where libraries built here go; default ``<quire cache>/kernels``.
    :param enabled: the platform's ``native`` option; None: ``QUIRE_CPU_NATIVE``'s
        (``0`` turns them off).
    :param isa: the platform's ``isa`` option: a level to run instead of the best (a
        lower one, to compare paths); None: the best.
    :param prebuilt: where the package build left its libraries; None: build here only.
    :returns: the kernels, or None (with the reason logged) when they are turned off,
        or no library fits and none can be built (no compiler, or every build or load
        fails).
    :raises ValueError: when ``isa`` names a level this CPU cannot run.
    """
    if enabled is None:
        enabled = os.environ.get(NATIVE_ENV, "1") != "0"
    if not enabled:
        logger.info("cpu platform: native kernels off (the native option, or %s=0)",
                    NATIVE_ENV)
        return None
    features = detect()
    levels = levels_for(features.machine)
    chosen = best_level(features, levels, forced=isa)
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if cache_root is None:
        from quire.model_store import cache_dir

        cache_root = cache_dir() / "kernels"
    # Forced: that level or none. Else the best, then lower ones (an older compiler may
    # not know a newer level's flags).
    candidates = [chosen] if isa is not None else levels[levels.index(chosen)::-1]
    for level in candidates:
        found = (kernel_build.find_prebuilt(prebuilt, features.machine, level)
                 if prebuilt is not None else kernel_build.Prebuilt(None))
        if found.reason:
            logger.info("cpu platform: prebuilt kernels not used: %s", found.reason)
        # the package's library first; a build here when there is none or it fails
        ways = [*([found.path] if found.path is not None else []),
                *([None] if compiler is not None else [])]
        for path in ways:
            try:
                path = path or _build(compiler, cache_root, level)
                kernels = NativeKernels(ctypes.CDLL(str(path)), path, level.name)
            except (OSError, subprocess.SubprocessError, AttributeError) as exc:
                logger.warning("cpu platform: native kernels for ISA level %s unavailable "
                               "(%s)", level.name, exc)
                continue
            origin = "prebuilt" if path == found.path else "built here"
            logger.info("cpu platform: native kernels at ISA level %s%s, %s: %s (cpu "
                        "features: %s)", level.name,
                        " (the isa option)" if isa is not None else "", origin, path,
                        " ".join(sorted(features.present)) or "none known")
            if "amx_tile" in level.needs and not kernels.has_amx:
                logger.warning("cpu platform: Linux refused this process AMX's tile state "
                               "(arch_prctl ARCH_REQ_XCOMP_PERM; Linux 5.16+); bfloat16 "
                               "products keep vdpbf16ps")
            return kernels
    if compiler is None:
        logger.warning("cpu platform: no C compiler (%s) found and no prebuilt kernels fit "
                       "(ISA level %s); decode attention, norms and fused layers use torch "
                       "ops, which makes decode steps several times slower (docs/bench.md). "
                       "Install gcc, or set the native option (%s) to 0 to silence this.",
                       os.environ.get("CC", "cc"), chosen.name, NATIVE_ENV)
        return None
    logger.warning("cpu platform: native kernels unavailable; decode steps use torch ops, "
                   "several times slower (docs/bench.md)")
    return None


def _build(compiler: str, cache_root: Path, level: IsaLevel) -> Path:
    """Build ``level``'s library into ``cache_root`` unless a build of the same sources,
    compiler and flags is there already."""
    key = hashlib.sha256()
    for part in (kernel_build.source_digest().encode(), compiler.encode(),
                 _compiler_version(compiler),
                 " ".join((*kernel_build.FLAGS, *level.flags)).encode(),
                 platform.machine().encode()):
        key.update(part)
        key.update(b"\0")
    target = cache_root / f"quire_cpu-{level.name}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    kernel_build.compile_library(compiler, level, target)
    logger.info("cpu platform: built native kernels %s", target)
    return target


def _compiler_version(compiler: str) -> bytes:
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, timeout=30,
                              check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return b""
