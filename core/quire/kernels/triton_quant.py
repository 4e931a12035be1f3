"""Portable Triton kernels for products with quantised weights: ``y = x W^T (+ bias)``
for a :class:`~quire.quantization.tensor.QuantizedTensor` ``W``, read in its stored
blocks and dequantised in registers.

Importing this module imports triton; :mod:`quire.kernels.triton_ops` imports it on the
op's first call. No vendor API: the same source compiles for any GPU Triton targets and
runs on CPU tensors under ``TRITON_INTERPRET=1`` (set before triton is imported).

Every format of :mod:`quire.quantization.formats` (GGUF's f32, f16, bf16, q4_0, q4_1,
q5_0, q5_1, q8_0, q2_k .. q6_k; Quire's row-scaled int8 and fp8_e4m3) goes through one
device function, ``_dequant``, switched on the format id at compile time: each weight of
a tile computes its block's address and its place in the block, gathers the bytes it
needs (its quant bits, its high bit, its sub-block scale, the block's f16 ``d``/``dmin``)
and rebuilds the float32 value with the same float32 operations, in the same order, as
:mod:`quire.quantization.dequant` (so, in the interpreter, bit for bit). f16/bf16/f32
are assembled from bytes (any row stride, any alignment); e4m3 is decoded with integer
ops (no fp8 hardware needed). Row-scaled formats multiply the per-row scale into the
accumulator once, after the sum (``(sum x q) s`` rather than ``sum x (q s)``).

Kernels (one program = one Triton program instance):

- ``_qmm_kernel``, grid ``(cdiv(M, BLOCK_M), cdiv(N, BLOCK_N), SPLIT_K)``: a
  ``[BLOCK_M, BLOCK_N]`` output tile over one contiguous share of K (split-K), tile after
  tile of ``BLOCK_K``: the x tile is loaded, the ``[BLOCK_N, BLOCK_K]`` weight tile
  (each row's bytes along the fast axis) is dequantised and transposed into ``tl.dot``,
  which accumulates in float32. float32 x: float32 operands in IEEE precision (never
  TF32). float16/bfloat16 x: the dequantised tile is rounded to x's dtype
  and the dot runs on half operands (tensor cores), float32 sums (so float16 x with
  f32/bf16 weights beyond float16's range would overflow; no such check is made).
- ``_qgemv_kernel``, grid ``(cdiv(N, BLOCK_N), SPLIT_K, M)``: for decode rows (M up to
  ``gemv_max_m``, default 1), one x row against ``BLOCK_N`` weight rows, no ``tl.dot``
  (whose 16-row minimum would waste 15/16 of it): ``[BLOCK_N, BLOCK_K]`` products summed
  in float32 registers, split-K so that a single row still fills the GPU.
- ``_qmm_act_kernel``: the same tiling with quantised activations: ``ACT_INT8`` (w8a8:
  int8 x int8 ``tl.dot``, int32 sums, the float scaling in float64 so the result is the
  reference's bit for bit), or ``ACT_FP8`` (e4m3 x e4m3 ``tl.dot``, float32 sums).
- ``_qmm_q8_kernel``: w8a8 on ``q8_0`` weights (``int8``'s 32-weight groups): the rows
  int8 per 32 values, one int8 ``tl.dot`` per 32-value block, each int32 block sum
  times both blocks' scales into float32 sums (so within float32 rounding of the
  reference, which sums in float64).

With one split the kernel adds the bias and stores x's dtype; with several it stores
float32 (int32 for w8a8) partial sums that torch adds up, then the bias and the cast.

What is verified, and where: ``tests/kernels/test_triton_quant.py`` runs every kernel in
Triton's interpreter on CPU tensors (every format, float32/float16/bfloat16 x, M = 1, 5,
33, split-K, strided rows, bias; dequantisation bit-exact through an identity product;
w8a8 bit-exact against :func:`quire.ops.quantized.quantized_linear`; the fp8-activation
path against a torch model of the same arithmetic, the interpreter emulating the fp8
``tl.dot`` in float32). Every kernel, every format, was cross-compiled (no GPU) for
sm_80, sm_89, sm_90 and gfx942 (the fp8 dot for all but sm_80, which Triton refuses);
the default tiles were picked from ptxas' register counts for sm_90. Nothing has run on
a GPU: speed and the compiled numerics (half-precision and fp8 dots, the float64 w8a8
scaling) are unmeasured. In the interpreter bfloat16 tiles are widened to float32
before the dot (its bfloat16 ``tl.dot`` multiplies raw bits, triton-lang/triton#11584).
The fp8-activation path (``activations="fp8"``) is refused below compute capability 8.9
on CUDA; on ROCm it is let through but untested (gfx942's own fp8 is the fnuz variant,
and whether Triton runs OCP e4m3 natively there is unknown). It is not the op's
contract: :func:`quantized_linear` never takes it.

Known costs, not yet worked on: every weight of a tile loads its block's scale bytes
itself (cache hits, but many load instructions; a K-quant weight takes up to eight),
where a tuned kernel would load a block's scales once and broadcast them; f16/bf16/f32
weights are assembled from single bytes; the w8a8 and fp8 activations are quantised by
torch (:func:`~quire.ops.quantized.quantize_activations`) before the kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# whether the kernels run in Triton's interpreter, fixed at import
from quire.kernels.triton_attention import INTERPRETED
from quire.kernels.triton_fused import _round  # the interpreter's bfloat16 rounding, shared
from quire.ops.quantized import quantize_activation_blocks, quantize_activations
from quire.quantization.tensor import QuantizedTensor

#: e4m3's largest finite value (the fp8-activation scale is ``max |x| / FP8_MAX``).
FP8_MAX = 448.0
#: ``activations`` modes: float (weight-only), int8 (w8a8), fp8 (e4m3 x e4m3).
ACT_FLOAT, ACT_INT8, ACT_FP8 = 0, 1, 2
_ACTS = {"float": ACT_FLOAT, "int8": ACT_INT8, "fp8": ACT_FP8}
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


# -- device functions -----------------------------------------------------------------------


@triton.jit
def _u8(ptr, mask):
    """The bytes at ``ptr`` as int32 (0 where masked)."""
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def _s8(ptr, mask):
    """The bytes at ``ptr`` as signed int8 values, in int32."""
    b = _u8(ptr, mask)
    return b - ((b & 0x80) << 1)


@triton.jit
def _f16(ptr, mask):
    """The little-endian float16 at ``ptr`` (two bytes, any alignment), as float32."""
    bits = _u8(ptr, mask) | (_u8(ptr + 1, mask) << 8)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _k_scale_min(base, s, mask):
    """Q4_K/Q5_K: sub-block ``s``'s 6-bit scale and minimum from the 12 packed bytes at
    ``base`` (``sc = p[s] & 63`` for s < 4, else ``p[s+4] & 15 | (p[s-4] >> 6) << 4``;
    the minimum likewise from ``p[s+4]`` / ``p[s+4] >> 4`` and ``p[s]``)."""
    t = s % 4
    a = _u8(base + t, mask)
    b = _u8(base + t + 4, mask)
    c = _u8(base + t + 8, mask)
    low = s < 4
    sc = tl.where(low, a & 63, (c & 15) | ((a >> 6) << 4))
    mn = tl.where(low, b & 63, (c >> 4) | ((b >> 6) << 4))
    return sc, mn


@triton.jit
def _dequant(w_ptr, rows, ks, mask, stride_w, FMT: tl.constexpr):
    """Weights ``(rows, ks)`` (int index tensors broadcast to one shape) as float32, 0
    where ``mask`` is false; row-scaled formats give the unscaled values. The float
    operations are :mod:`quire.quantization.dequant`'s, in its order."""
    row = w_ptr + rows.to(tl.int64) * stride_w
    if FMT == 0:  # f32
        p = row + ks * 4
        bits = (_u8(p, mask) | (_u8(p + 1, mask) << 8) | (_u8(p + 2, mask) << 16)).to(tl.uint32)
        bits = bits | (_u8(p + 3, mask).to(tl.uint32) << 24)
        w = bits.to(tl.float32, bitcast=True)
    elif FMT == 1:  # f16
        w = _f16(row + ks * 2, mask)
    elif FMT == 30:  # bf16
        p = row + ks * 2
        bits = (_u8(p, mask) | (_u8(p + 1, mask) << 8)).to(tl.uint32) << 16
        w = bits.to(tl.float32, bitcast=True)
    elif FMT == 2:  # q4_0: d, qs[16]; q = nibble - 8
        base = row + (ks // 32) * 18
        j = ks % 32
        q = (_u8(base + 2 + j % 16, mask) >> ((j // 16) * 4)) & 0xF
        w = _f16(base, mask) * (q - 8).to(tl.float32)
    elif FMT == 3:  # q4_1: d, m, qs[16]; w = d q + m
        base = row + (ks // 32) * 20
        j = ks % 32
        q = (_u8(base + 4 + j % 16, mask) >> ((j // 16) * 4)) & 0xF
        w = _f16(base, mask) * q.to(tl.float32) + _f16(base + 2, mask)
    elif FMT == 6:  # q5_0: d, qh[4] (bit j of the LE word is weight j's fifth bit), qs[16]
        base = row + (ks // 32) * 22
        j = ks % 32
        high = (_u8(base + 2 + j // 8, mask) >> (j % 8)) & 1
        q = ((_u8(base + 6 + j % 16, mask) >> ((j // 16) * 4)) & 0xF) | (high << 4)
        w = _f16(base, mask) * (q - 16).to(tl.float32)
    elif FMT == 7:  # q5_1: d, m, qh[4], qs[16]
        base = row + (ks // 32) * 24
        j = ks % 32
        high = (_u8(base + 4 + j // 8, mask) >> (j % 8)) & 1
        q = ((_u8(base + 8 + j % 16, mask) >> ((j // 16) * 4)) & 0xF) | (high << 4)
        w = _f16(base, mask) * q.to(tl.float32) + _f16(base + 2, mask)
    elif FMT == 8:  # q8_0: d, qs[32] int8
        base = row + (ks // 32) * 34
        w = _s8(base + 2 + ks % 32, mask).to(tl.float32) * _f16(base, mask)
    elif FMT == 10:  # q2_k: scales[16] (4-bit scale | 4-bit min << 4), qs[64], d, dmin
        base = row + (ks // 256) * 84
        j = ks % 256
        sc = _u8(base + j // 16, mask)
        dl = _f16(base + 80, mask) * (sc & 0xF).to(tl.float32)
        ml = _f16(base + 82, mask) * (sc >> 4).to(tl.float32)
        q = (_u8(base + 16 + (j // 128) * 32 + j % 32, mask) >> (((j % 128) // 32) * 2)) & 3
        w = dl * q.to(tl.float32) - ml
    elif FMT == 11:  # q3_k: hmask[32], qs[64], scales[12] (16 x 6 bits, offset 32), d
        base = row + (ks // 256) * 110
        j = ks % 256
        s = j // 16
        low = (_u8(base + 96 + s % 8, mask) >> ((s // 8) * 4)) & 0xF
        top = (_u8(base + 104 + s % 4, mask) >> ((s // 4) * 2)) & 3
        dl = _f16(base + 108, mask) * ((low | (top << 4)) - 32).to(tl.float32)
        ql = (_u8(base + 32 + (j // 128) * 32 + j % 32, mask) >> (((j % 128) // 32) * 2)) & 3
        qh = (_u8(base + j % 32, mask) >> (j // 32)) & 1
        w = dl * (ql - ((qh ^ 1) << 2)).to(tl.float32)
    elif FMT == 12:  # q4_k: d, dmin, scales[12] (8 x 6-bit scale and min), qs[128]
        base = row + (ks // 256) * 144
        j = ks % 256
        s = j // 32
        sc, mn = _k_scale_min(base + 4, s, mask)
        scale = _f16(base, mask) * sc.to(tl.float32)
        minimum = _f16(base + 2, mask) * mn.to(tl.float32)
        q = (_u8(base + 16 + (s // 2) * 32 + j % 32, mask) >> ((s % 2) * 4)) & 0xF
        w = scale * q.to(tl.float32) - minimum
    elif FMT == 13:  # q5_k: d, dmin, scales[12], qh[32] (bit s: sub-block s), qs[128]
        base = row + (ks // 256) * 176
        j = ks % 256
        s = j // 32
        sc, mn = _k_scale_min(base + 4, s, mask)
        scale = _f16(base, mask) * sc.to(tl.float32)
        minimum = _f16(base + 2, mask) * mn.to(tl.float32)
        high = (_u8(base + 16 + j % 32, mask) >> s) & 1
        q = ((_u8(base + 48 + (s // 2) * 32 + j % 32, mask) >> ((s % 2) * 4)) & 0xF) | (high << 4)
        w = scale * q.to(tl.float32) - minimum
    elif FMT == 14:  # q6_k: ql[128], qh[64], scales[16] int8, d
        base = row + (ks // 256) * 210
        j = ks % 256
        r = j % 128
        low = (_u8(base + (j // 128) * 64 + r % 64, mask) >> ((r // 64) * 4)) & 0xF
        top = (_u8(base + 128 + (j // 128) * 32 + r % 32, mask) >> ((r // 32) * 2)) & 3
        d = _f16(base + 208, mask) * _s8(base + 192 + j // 16, mask).to(tl.float32)
        w = d * ((low | (top << 4)) - 32).to(tl.float32)
    elif FMT == 256:  # int8 (unscaled)
        w = _s8(row + ks, mask).to(tl.float32)
    else:  # 257, fp8 e4m3fn (unscaled): sign, 4-bit exponent (bias 7), 3-bit mantissa
        b = _u8(row + ks, mask)
        e = (b >> 3) & 15
        m = b & 7
        normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
        mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)  # m * 2^-9
        nan = (b * 0 + 0x7FC00000).to(tl.float32, bitcast=True)
        mag = tl.where((b & 0x7F) == 0x7F, nan, mag)
        w = tl.where(b >= 128, -mag, mag)
    return tl.where(mask, w, 0.0)


# -- kernels --------------------------------------------------------------------------------


@triton.jit
def _qmm_kernel(
    x_ptr, w_ptr, ws_ptr, b_ptr, y_ptr,
    M, N, K, k_split,
    stride_xm, stride_w, stride_ym, stride_ys,
    FMT: tl.constexpr, ROW_SCALED: tl.constexpr, HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    k_start = pid_k * k_split
    k_end = tl.minimum(K, k_start + k_split)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k_end
        x = tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        # [BLOCK_N, BLOCK_K], a row's bytes along the fast axis; transposed for the dot
        w = _dequant(w_ptr, offs_n[:, None], offs_k[None, :], n_ok[:, None] & k_ok[None, :],
                     stride_w, FMT)
        if DOT_FP32:
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    if ROW_SCALED:
        acc = acc * tl.load(ws_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
    out_mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        out = _round(acc, y_ptr.dtype.element_ty, INTERPRETED).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :], out,
                 mask=out_mask)
    else:  # float32 partial sums [SPLIT, M, N]
        tl.store(y_ptr + pid_k * stride_ys + offs_m.to(tl.int64)[:, None] * stride_ym
                 + offs_n[None, :], acc, mask=out_mask)


@triton.jit
def _qgemv_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, y_ptr,
    N, K, k_split,
    stride_xm, stride_w, stride_ym, stride_ys,
    FMT: tl.constexpr, ROW_SCALED: tl.constexpr, HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr, ACT_INT8: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    m = tl.program_id(2).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    k_start = pid_k * k_split
    k_end = tl.minimum(K, k_start + k_split)
    if ACT_INT8:
        acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.int32)
    else:
        acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k_end
        mask = n_ok[:, None] & k_ok[None, :]
        if ACT_INT8:  # int8 rows and weights, exact int32 products and sums
            x = tl.load(x_ptr + m * stride_xm + offs_k, mask=k_ok, other=0).to(tl.int32)
            w = _s8(w_ptr + offs_n.to(tl.int64)[:, None] * stride_w + offs_k[None, :], mask)
            acc2 += w * x[None, :]
        else:
            x = tl.load(x_ptr + m * stride_xm + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            w = _dequant(w_ptr, offs_n[:, None], offs_k[None, :], mask, stride_w, FMT)
            acc2 += w * x[None, :]
    acc = tl.sum(acc2, axis=1)
    y_off = m * stride_ym + offs_n
    if SPLIT == 1:
        if ACT_INT8:  # the reference's float64 scaling: (acc * sx) * sw, then float32
            sx = tl.load(xs_ptr + m).to(tl.float64)
            sw = tl.load(ws_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float64)
            y = (acc.to(tl.float64) * sx * sw).to(tl.float32)
        elif ROW_SCALED:
            y = acc * tl.load(ws_ptr + offs_n, mask=n_ok, other=0.0)
        else:
            y = acc
        if HAS_BIAS:
            y += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        out = _round(y, y_ptr.dtype.element_ty, INTERPRETED).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + y_off, out, mask=n_ok)
    else:  # partial sums [SPLIT, M, N]: int32 (w8a8) or float32, scaled if row-scaled
        if ROW_SCALED and not ACT_INT8:
            acc = acc * tl.load(ws_ptr + offs_n, mask=n_ok, other=0.0)
        tl.store(y_ptr + pid_k * stride_ys + y_off, acc, mask=n_ok)


@triton.jit
def _qmm_act_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, y_ptr,
    M, N, K, k_split,
    stride_xm, stride_w, stride_ym, stride_ys,
    ACT: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    k_start = pid_k * k_split
    k_end = tl.minimum(K, k_start + k_split)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_w
    if ACT == 1:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k_end
        # both operands are bytes: int8 values, or e4m3 (0 is +0.0 in both)
        x = tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0)
        w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
        if ACT == 1:
            acc += tl.dot(x.to(tl.int8, bitcast=True), tl.trans(w.to(tl.int8, bitcast=True)),
                          out_dtype=tl.int32)
        else:
            acc += tl.dot(x.to(tl.float8e4nv, bitcast=True),
                          tl.trans(w.to(tl.float8e4nv, bitcast=True)))
    out_mask = m_ok[:, None] & n_ok[None, :]
    y_off = offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    if SPLIT == 1:
        sx = tl.load(xs_ptr + offs_m, mask=m_ok, other=0.0)
        sw = tl.load(ws_ptr + offs_n, mask=n_ok, other=0.0)
        if ACT == 1:  # the reference's float64 scaling: (acc * sx) * sw, then float32
            y = (acc.to(tl.float64) * sx.to(tl.float64)[:, None]
                 * sw.to(tl.float64)[None, :]).to(tl.float32)
        else:
            y = acc * sx[:, None] * sw[None, :]
        if HAS_BIAS:
            y += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        out = _round(y, y_ptr.dtype.element_ty, INTERPRETED).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + y_off, out, mask=out_mask)
    else:  # unscaled partial sums [SPLIT, M, N] (int32 or float32)
        tl.store(y_ptr + pid_k * stride_ys + y_off, acc, mask=out_mask)


@triton.jit
def _qmm_q8_kernel(
    x_ptr, xd_ptr, w_ptr, b_ptr, y_ptr,
    M, N, K, k_split,
    stride_xm, stride_xd, stride_w, stride_ym, stride_ys,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """w8a8 on Q8_0 blocks: int8 rows with a float32 scale per 32 values (``xd``) times
    the blocks' int8 codes, one int8 ``tl.dot`` per 32-value block (exact int32 sums),
    each scaled by both blocks' scales into float32 sums."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    k_start = pid_k * k_split
    k_end = tl.minimum(K, k_start + k_split)
    offs_c = tl.arange(0, 32)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, 32):
        b = k0 // 32
        x = tl.load(x_rows + k0 + offs_c[None, :], mask=m_ok[:, None], other=0)
        w = tl.load(w_rows + b * 34 + 2 + offs_c[None, :], mask=n_ok[:, None], other=0)
        isum = tl.dot(x.to(tl.int8, bitcast=True), tl.trans(w.to(tl.int8, bitcast=True)),
                      out_dtype=tl.int32)
        dx = tl.load(xd_ptr + offs_m.to(tl.int64) * stride_xd + b, mask=m_ok, other=0.0)
        dw = _f16(w_ptr + offs_n.to(tl.int64) * stride_w + b * 34, n_ok)
        acc += isum.to(tl.float32) * (dx[:, None] * dw[None, :])
    out_mask = m_ok[:, None] & n_ok[None, :]
    y_off = offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    if SPLIT == 1:
        y = acc
        if HAS_BIAS:
            y += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        out = _round(y, y_ptr.dtype.element_ty, INTERPRETED).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + y_off, out, mask=out_mask)
    else:  # float32 partial sums [SPLIT, M, N]
        tl.store(y_ptr + pid_k * stride_ys + y_off, acc, mask=out_mask)


# -- launchers ------------------------------------------------------------------------------


def quantized_linear(x: torch.Tensor, weight: QuantizedTensor,
                     bias: torch.Tensor | None = None, *,
                     int8_activations: bool = False) -> torch.Tensor:
    """:func:`quire.ops.quantized.quantized_linear`'s contract in the Triton kernels.

    Weight-only (default): float32 sums of ``x`` times the dequantised weights (with
    float16/bfloat16 ``x`` the weight tile is rounded to ``x``'s dtype for the dot, see
    the module notes). ``int8_activations``: w8a8, the reference's result bit for bit.
    """
    return quantized_matmul(x, weight, bias,
                            activations="int8" if int8_activations else "float")


def quantized_matmul(x: torch.Tensor, weight: QuantizedTensor,
                     bias: torch.Tensor | None = None, *, activations: str = "float",
                     block_m: int | None = None, block_n: int | None = None,
                     block_k: int | None = None, split_k: int | None = None,
                     gemv_max_m: int = 1, num_warps: int | None = None) -> torch.Tensor:
    """``x W^T (+ bias)``: ``[..., cols] -> [..., rows]`` in ``x``'s dtype.

    :param activations: ``"float"`` (weight-only, any format), ``"int8"`` (w8a8, int8
        weights), ``"fp8"`` (x per row to e4m3 with ``scale = max |x| / 448``, e4m3 x e4m3
        ``tl.dot``; fp8_e4m3 weights, and on a GPU compute capability 8.9 or more; not
        verified on a GPU, see the module notes).
    :param block_m, block_n, block_k: tile sizes, powers of two of at least 16.
        :param num_warps: warps per program. Defaults by shape and dtype, chosen so that
        ptxas (sm_90) reports no or almost no spills for every format (see
        :func:`_tiles`). :param split_k: shares of K (default: enough to fill a GPU's
        multiprocessors, 1 on CPU). :param gemv_max_m: up to this many rows take the
        GEMV kernel (weight-only and w8a8).
    :raises ValueError: on shapes, dtypes, formats or tiles that do not fit.
    :raises RuntimeError: for CPU tensors when triton was imported without the
        interpreter, or the fp8 path on a device without fp8.
    """
    act = _ACTS.get(activations)
    if act is None:
        raise ValueError(f"activations={activations!r}: one of {', '.join(_ACTS)}")
    fmt = weight.format
    if act == ACT_INT8 and fmt.name == "q8_0":
        return _q8_blocks_matmul(x, weight, bias, block_m=block_m, block_n=block_n,
                                 split_k=split_k, num_warps=num_warps)
    if act == ACT_INT8 and fmt.name != "int8":
        raise ValueError(f"int8 activations need int8 weights (per row, or q8_0 blocks), "
                         f"got {fmt.name}")
    if act == ACT_FP8 and fmt.name != "fp8_e4m3":
        raise ValueError(f"fp8 activations need fp8_e4m3 weights, got {fmt.name}")
    if x.dtype not in _FLOATS:
        raise ValueError(f"x must be float32, float16 or bfloat16, got {x.dtype}")
    if x.shape[-1] != weight.cols:
        raise ValueError(f"x has {x.shape[-1]} features, the weight {weight.cols} columns")
    if bias is not None and tuple(bias.shape) != (weight.rows,):
        raise ValueError(f"bias must be [{weight.rows}], got {tuple(bias.shape)}")
    for name, b in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        if b is not None and (b < 16 or b & (b - 1)):
            raise ValueError(f"{name}={b} must be a power of two of at least 16")
    if split_k is not None and split_k < 1:
        raise ValueError(f"split_k={split_k} must be at least 1")
    if x.device.type == "cpu" and not INTERPRETED:
        raise RuntimeError("the triton quantized_linear got CPU tensors, but triton was "
                           "imported without TRITON_INTERPRET=1; set it before triton is "
                           "first imported to run on CPU")
    if act == ACT_FP8 and x.device.type == "cuda" and \
            torch.cuda.get_device_capability(x.device) < (8, 9):
        raise RuntimeError("fp8 activations need fp8 tensor cores (compute capability "
                           "8.9 or more)")
    k, n = weight.cols, weight.rows
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    if m == 0 or n == 0 or k == 0:
        y = torch.zeros(m, n, dtype=torch.float32, device=x.device)
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], n)
    data = weight.data
    stride_w = data.stride(0) if n > 1 else data.shape[1]
    scale = weight.scale
    if bias is not None:
        bias = bias.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    dummy = y  # a pointer for absent operands (never read)
    gemv = m <= gemv_max_m and act != ACT_FP8

    if act != ACT_FLOAT:  # activations quantised per row
        if act == ACT_INT8:
            qx, sx = quantize_activations(rows)
            qx = qx.view(torch.uint8) if not gemv else qx
        else:
            qx, sx = _quantize_fp8(rows)
        stride_xm = qx.stride(0)
    else:
        qx, sx, stride_xm = rows, None, rows.stride(0)

    bm, bn, bk, warps = _tiles(m, x.dtype, act, gemv)
    bm, bn, bk = block_m or bm, block_n or bn, block_k or bk
    num_warps = num_warps or warps
    if gemv:
        split, k_split = _splits(split_k, triton.cdiv(n, bn) * m, k, bk, x.device)
        out = y if split == 1 else torch.empty(
            split, m, n, dtype=torch.int32 if act == ACT_INT8 else torch.float32,
            device=x.device)
        _qgemv_kernel[(triton.cdiv(n, bn), split, m)](
            qx, dummy if sx is None else sx, data, dummy if scale is None else scale,
            dummy if bias is None else bias, out, n, k, k_split,
            stride_xm, stride_w, out.stride(-2), out.stride(0) if split > 1 else 0,
            FMT=fmt.id, ROW_SCALED=fmt.row_scaled, HAS_BIAS=bias is not None,
            SPLIT=split, ACT_INT8=act == ACT_INT8, BLOCK_N=bn, BLOCK_K=bk,
            INTERPRETED=INTERPRETED, num_warps=num_warps, **_compile_options(),
        )
    else:
        tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
        split, k_split = _splits(split_k, tiles, k, bk, x.device)
        grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), split)
        if act == ACT_FLOAT:
            out = y if split == 1 else torch.empty(split, m, n, dtype=torch.float32,
                                                  device=x.device)
            dot_fp32 = x.dtype == torch.float32 or (INTERPRETED and x.dtype == torch.bfloat16)
            _qmm_kernel[grid](
                qx, data, dummy if scale is None else scale, dummy if bias is None else bias,
                out, m, n, k, k_split, stride_xm, stride_w, out.stride(-2),
                out.stride(0) if split > 1 else 0,
                FMT=fmt.id, ROW_SCALED=fmt.row_scaled, HAS_BIAS=bias is not None,
                SPLIT=split, DOT_FP32=dot_fp32, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                INTERPRETED=INTERPRETED, num_warps=num_warps, **_compile_options(),
            )
        else:
            out = y if split == 1 else torch.empty(
                split, m, n, dtype=torch.int32 if act == ACT_INT8 else torch.float32,
                device=x.device)
            _qmm_act_kernel[grid](
                qx, sx, data, scale, dummy if bias is None else bias, out,
                m, n, k, k_split, stride_xm, stride_w, out.stride(-2),
                out.stride(0) if split > 1 else 0,
                ACT=act, HAS_BIAS=bias is not None, SPLIT=split,
                BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, INTERPRETED=INTERPRETED,
                num_warps=num_warps, **_compile_options(),
            )
    if split > 1:
        y = _reduce_splits(out, act, sx, scale, bias).to(x.dtype)
    return y.reshape(*x.shape[:-1], n)


def _q8_blocks_matmul(x: torch.Tensor, weight: QuantizedTensor, bias: torch.Tensor | None,
                      *, block_m: int | None, block_n: int | None, split_k: int | None,
                      num_warps: int | None) -> torch.Tensor:
    """w8a8 on ``q8_0`` weights (``_qmm_q8_kernel``): the rows quantised per 32 values by
    torch (:func:`~quire.ops.quantized.quantize_activation_blocks`), every row count on
    the tiled kernel (K steps are the 32-value blocks)."""
    if x.dtype not in _FLOATS:
        raise ValueError(f"x must be float32, float16 or bfloat16, got {x.dtype}")
    if x.shape[-1] != weight.cols:
        raise ValueError(f"x has {x.shape[-1]} features, the weight {weight.cols} columns")
    if bias is not None and tuple(bias.shape) != (weight.rows,):
        raise ValueError(f"bias must be [{weight.rows}], got {tuple(bias.shape)}")
    if x.device.type == "cpu" and not INTERPRETED:
        raise RuntimeError("the triton quantized_linear got CPU tensors, but triton was "
                           "imported without TRITON_INTERPRET=1; set it before triton is "
                           "first imported to run on CPU")
    k, n = weight.cols, weight.rows
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    if m == 0 or n == 0:
        y = torch.zeros(m, n, dtype=torch.float32, device=x.device)
        y = y if bias is None else y + bias.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], n)
    qx, dx = quantize_activation_blocks(rows)
    qx = qx.view(torch.uint8)
    data = weight.data
    stride_w = data.stride(0) if n > 1 else data.shape[1]
    bm = block_m or (16 if m <= 16 else 32 if m <= 32 else 64)
    bn = block_n or 64
    split, k_split = _splits(split_k, triton.cdiv(m, bm) * triton.cdiv(n, bn), k, 32,
                             x.device)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    out = y if split == 1 else torch.empty(split, m, n, dtype=torch.float32,
                                           device=x.device)
    if bias is not None:
        bias = bias.contiguous()
    _qmm_q8_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn), split)](
        qx, dx, data, y if bias is None else bias, out, m, n, k, k_split,
        qx.stride(0), dx.stride(0), stride_w, out.stride(-2),
        out.stride(0) if split > 1 else 0,
        HAS_BIAS=bias is not None, SPLIT=split, BLOCK_M=bm, BLOCK_N=bn,
        INTERPRETED=INTERPRETED, num_warps=num_warps or 4, **_compile_options(),
    )
    if split > 1:
        y = out.sum(0)
        y = (y if bias is None else y + bias.float()).to(x.dtype)
    return y.reshape(*x.shape[:-1], n)


def _tiles(m: int, dtype: torch.dtype, act: int, gemv: bool) -> tuple[int, int, int, int]:
    """Default (BLOCK_M, BLOCK_N, BLOCK_K, num_warps). Each weight of a tile gathers its
    bytes separately (up to eight loads for the K-quants), so tiles are kept small
    enough for registers: cross-compiled for sm_90, ptxas reports no spills for these
    (at most 16 bytes of stack for float32 x with 16-row tiles), where 64 x 128 GEMV
    tiles or 64 x 64 x 64 dot tiles with 4 warps spill kilobytes."""
    if gemv:
        return 1, 32, 64, 4
    if act != ACT_FLOAT:  # byte operands, no dequantisation
        return (16 if m <= 16 else 32 if m <= 32 else 64), 64, 128, 4
    if dtype == torch.float32:  # IEEE float32 dot: large operand layouts
        return (16 if m <= 16 else 32), 32, 32, 4
    bm = 16 if m <= 16 else 32 if m <= 32 else 64
    return bm, 64, 32, 8 if bm == 64 else 4


def _reduce_splits(parts: torch.Tensor, act: int, sx: torch.Tensor | None,
                   scale: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """The split-K partial sums ``[S, M, N]`` to float32 ``[M, N]``: scaled as the
    single-split kernels scale (w8a8 in float64, as the reference), bias added."""
    if act == ACT_INT8:  # exact integer sums, then the reference's float64 scaling
        acc = parts.sum(0, dtype=torch.int64).double()
        y = (acc * sx.double().unsqueeze(1) * scale.double()).float()
    elif act == ACT_FP8:
        y = parts.sum(0) * sx.unsqueeze(1) * scale
    else:  # float32 sums, row scales already applied per split
        y = parts.sum(0)
    if bias is not None:
        y = y + bias.float()
    return y


def _quantize_fp8(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row as e4m3 bytes (``scale = max |x| / 448``, 1 for a zero row; round to
    nearest) and its float32 scale."""
    xf = rows.float()
    amax = xf.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_MAX, 1.0)
    q = (xf / scale.unsqueeze(1)).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(torch.uint8), scale


def _splits(split_k: int | None, programs: int, k: int, block_k: int,
            device: torch.device) -> tuple[int, int]:
    """(shares of K, K per share, a multiple of ``block_k``). By default a GPU gets
    enough shares for about two programs per multiprocessor, each share at least four
    ``block_k`` steps; CPU (the interpreter) gets one."""
    steps = triton.cdiv(k, block_k)
    if split_k is None:
        split_k = 1
        if device.type == "cuda":
            target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
            if programs < target:
                split_k = max(1, min(triton.cdiv(target, programs), steps // 4, 32))
    split_k = min(split_k, steps)
    k_split = triton.cdiv(steps, split_k) * block_k
    return triton.cdiv(k, k_split), k_split


def _compile_options() -> dict[str, bool]:
    """No multiply-add contraction in compiled kernels, so the dequantised weights are
    the reference's float32 values (``d * q + m`` rounded twice, not fused)."""
    return {} if INTERPRETED else {"enable_fp_fusion": False}
