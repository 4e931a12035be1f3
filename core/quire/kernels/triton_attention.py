"""Portable Triton kernels for paged attention, and the host functions that launch them.

Importing this module imports triton; only :mod:`quire.kernels.triton_backend` imports it,
and only when a kernel is first launched. No vendor API is used: the same source compiles
for any GPU that Triton targets, and runs on CPU tensors under ``TRITON_INTERPRET=1`` (which
must be set before triton is first imported, because ``@triton.jit`` reads it when this
module defines the kernels).

KV cache, per layer: ``[2, num_blocks, block_size, Hkv, D]`` (0 = keys, 1 = values), the
cpu reference's layout; int8 / fp8 pages hold rows of ``D + D / 8`` (the values, then a
float16 scale per 16 of them: ``quire.ops.kv_quant``), dequantised in the attention
kernels as each tile is loaded; int8 groups are in the Hadamard basis, which the kernels
meet by rotating the queries at load and the outputs before they are stored. The
launchers take the key and value halves as two views, ``k_cache``/``v_cache`` of shape
``[num_blocks, block_size, Hkv, D]`` with the head dim contiguous; every other stride is
passed to the kernels.

Kernels (one program = one Triton program instance):

- ``_write_kv_kernel``, grid ``(T,)``: one token's ``[Hkv, D]`` keys and values to its slot.
- ``_prefill_kernel``, grid ``(query blocks, Hkv * head_chunks)``: ``BLOCK_Q`` query tokens
  of one sequence times ``HEADS`` query heads of one GQA group, against every key they may
  see, tile after tile of ``TILE_N`` keys (online softmax).
- ``_decode_kernel``, grid ``(decode seqs, Hkv, splits)``: the single query token of one
  sequence, all ``G`` heads of a GQA group as the rows of one tile (K/V read once per
  group), over one contiguous share of the keys (split-K).
- ``_decode_reduce_kernel``, grid ``(decode seqs, Hq)``: merges the splits' partial
  results; skipped when there is one split (the decode kernel then writes the output).

Numerics: scores, softmax statistics and accumulators are float32; scores are kept in
base 2 (multiplied by log2 e) so the exponentials are ``exp2``. float32 operands use
``input_precision="ieee"`` (never TF32), so float32 results match the reference closely.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def _interpreter_on() -> bool:
    """What ``@triton.jit`` will decide below (``triton.knobs`` exists from triton 3.4)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


#: Whether the kernels run in Triton's interpreter (numpy on CPU tensors), fixed at import.
INTERPRETED: bool = _interpreter_on()

#: log2(e): scores are kept in base 2 so the softmax uses exp2.
LOG2E = tl.constexpr(1.4426950408889634)


# -- kernels --------------------------------------------------------------------------------


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_co, stride_ch,
    num_kv_heads, head_size, block_size,
    H_PAD: tl.constexpr, D_PAD: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, H_PAD)[:, None]
    d = tl.arange(0, D_PAD)[None, :]
    # A negative slot marks a padding token: nothing is written. It is masked rather than
    # returned early from, and broadcast to a tensor first because the interpreter
    # mis-types ``bool tensor & bool scalar``.
    mask = (h < num_kv_heads) & (d < head_size) & ((h * 0 + slot) >= 0)
    dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_co + h * stride_ch + d
    k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


@triton.jit
def _fp8_e4m3_to_f32(x):
    """float8 e4m3fn bytes (uint8) as float32, from their bits: portable to every GPU (no
    fp8 type needed; ROCm's native fp8 is the fnuz variant) and to the interpreter."""
    b = x.to(tl.uint32)
    e = (b >> 3) & 15
    m = b & 7
    sign = (b >> 7) << 31
    normal = (sign | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * 0.001953125  # e = 0: m * 2**-9
    sub = tl.where(sign != 0, -sub, sub)
    out = tl.where(e == 0, sub, normal)
    return tl.where((e == 15) & (m == 7), float("nan"), out)


@triton.jit
def _softcap(s, cap):
    """``cap * tanh(s / cap)``; tanh from exp2, since tl has no portable tanh."""
    e = tl.exp2(s / cap * (2.0 * LOG2E))  # exp(2 s / cap); overflow to inf is fine
    return cap * (1.0 - 2.0 / (e + 1.0))


@triton.jit
def _hadamard16(x, D_PAD: tl.constexpr):
    """``x`` [M, D_PAD] in float32 with each group of 16 along D times the orthonormal
    16 x 16 Hadamard matrix (symmetric, its own inverse), whose basis int8 pages store
    their groups in (``quire.ops.kv_quant``): one ``tl.dot`` of the groups as rows,
    [M * D_PAD / 16, 16] by [16, 16]. Rotating each query and each output once stands for
    rotating every key and value read: ``(H q) . k' = q . k``."""
    i = tl.arange(0, 16)[:, None]
    j = tl.arange(0, 16)[None, :]
    both = i & j
    odd = (both ^ (both >> 1) ^ (both >> 2) ^ (both >> 3)) & 1  # parity: the sign
    h = tl.where(odd == 1, -0.25, 0.25)
    rows: tl.constexpr = x.shape[0]
    groups = tl.reshape(x.to(tl.float32), (rows * D_PAD // 16, 16))
    return tl.reshape(tl.dot(groups, h, input_precision="ieee"), (rows, D_PAD))


@triton.jit
def _attend_tile(
    acc, m_i, l_i, q, pos,
    j0, kv_end, bt_row_ptr,
    k_cache_ptr, v_cache_ptr, stride_cb, stride_co, stride_ch,
    kv_head, block_size, head_size,
    scale, soft_cap, window,
    ks_ptr, vs_ptr,
    TILE_N: tl.constexpr, D_PAD: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, QUANT: tl.constexpr,
):
    """One online-softmax step of rows ``q`` [M, D_PAD] over keys ``j0 .. j0+TILE_N``.

    ``QUANT`` 1 (int8) or 2 (fp8 e4m3, read as bytes): rows of ``head_size * 9 / 8``
    bytes, the values then a float16 scale per 16 of them, which ``ks_ptr``/``vs_ptr``
    (the caches seen as float16) read at ``(row + head_size) / 2 + d / 16``; the tiles
    are dequantised in registers.

    Keys at ``j >= kv_end`` are never loaded: a slot past a sequence's end may hold
    anything, NaN included, and a masked score would not cancel a NaN value. Rows see keys
    ``j <= pos`` (and ``j > pos - window``). ``m_i`` is in base 2 and ``-inf`` while a row
    has seen no key; ``acc`` is unnormalised.
    """
    j = j0 + tl.arange(0, TILE_N)
    kv_ok = j < kv_end
    # Any block size works: each key finds its own page, so a tile may span pages.
    blk = tl.load(bt_row_ptr + j // block_size, mask=kv_ok, other=0).to(tl.int64)
    base = blk * stride_cb + (j % block_size) * stride_co + kv_head * stride_ch  # [TILE_N]
    d = tl.arange(0, D_PAD)
    d_ok = d < head_size
    k_t = tl.load(k_cache_ptr + base[None, :] + d[:, None],
                  mask=d_ok[:, None] & kv_ok[None, :], other=0.0)  # [D_PAD, TILE_N]
    v = tl.load(v_cache_ptr + base[:, None] + d[None, :],
                mask=kv_ok[:, None] & d_ok[None, :], other=0.0)  # [TILE_N, D_PAD]
    if QUANT != 0:
        if QUANT == 1:
            k_t = k_t.to(tl.float32)
            v = v.to(tl.float32)
        else:
            k_t = _fp8_e4m3_to_f32(k_t)
            v = _fp8_e4m3_to_f32(v)
        srow = (base + head_size) // 2  # the row's first scale, as a float16 index
        group = d // 16  # each value's scale within them
        k_t = k_t * tl.load(ks_ptr + srow[None, :] + group[:, None],
                            mask=d_ok[:, None] & kv_ok[None, :], other=0.0).to(tl.float32)
        v = v * tl.load(vs_ptr + srow[:, None] + group[None, :],
                        mask=kv_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        if not DOT_FP32:
            k_t = k_t.to(q.dtype)
            v = v.to(q.dtype)
    elif DOT_FP32:
        k_t = k_t.to(tl.float32)
        v = v.to(tl.float32)

    s = tl.dot(q, k_t, input_precision=PRECISION) * scale
    if USE_SOFTCAP:
        s = _softcap(s, soft_cap)
    allowed = kv_ok[None, :] & (j[None, :] <= pos[:, None])
    if USE_WINDOW:
        allowed = allowed & (j[None, :] > pos[:, None] - window)
    s = tl.where(allowed, s * LOG2E, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen no allowed key yet keeps m = -inf; subtracting 0 instead keeps
    # exp2 away from (-inf) - (-inf) = NaN.
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_ref[:, None])
    alpha = tl.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _prefill_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, ks_ptr, vs_ptr, block_tables_ptr,
    query_start_ptr, seq_lens_ptr, qblock_seq_ptr, qblock_idx_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    stride_cb, stride_co, stride_ch,
    head_size, block_size, scale, soft_cap, window,
    GROUP: tl.constexpr, HEADS: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, D_PAD: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, QUANT: tl.constexpr,
):
    qb = tl.program_id(0)
    num_chunks: tl.constexpr = (GROUP + HEADS - 1) // HEADS
    kv_head = tl.program_id(1) // num_chunks
    chunk = tl.program_id(1) % num_chunks

    seq = tl.load(qblock_seq_ptr + qb)
    first_t = tl.load(qblock_idx_ptr + qb) * BLOCK_Q
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    cached = seq_len - q_len  # the new tokens are the last q_len of the sequence

    # Row r is token first_t + r // HEADS, query head kv_head * GROUP + chunk * HEADS + r % HEADS.
    r = tl.arange(0, BLOCK_M)
    t = first_t + r // HEADS
    g = chunk * HEADS + r % HEADS
    row_ok = (r < BLOCK_Q * HEADS) & (t < q_len) & (g < GROUP)
    head = kv_head * GROUP + g
    pos = cached + t
    d = tl.arange(0, D_PAD)
    d_ok = d < head_size
    q_rows = (q_start + t).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    elif QUANT == 0:
        q = q.to(k_cache_ptr.dtype.element_ty)
    if QUANT == 1:  # int8 keys and values are read in the Hadamard basis
        q = _hadamard16(q, D_PAD).to(q.dtype)

    # Keys any row of this block may see: up to the last real row's position, and from the
    # first row's window start.
    kv_end = cached + tl.minimum(first_t + BLOCK_Q, q_len)
    kv_start = 0
    if USE_WINDOW:
        kv_start = tl.maximum(cached + first_t - window + 1, 0)
    bt_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt

    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for j0 in range((kv_start // TILE_N) * TILE_N, kv_end, TILE_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, pos, j0, kv_end, bt_row_ptr,
            k_cache_ptr, v_cache_ptr, stride_cb, stride_co, stride_ch,
            kv_head, block_size, head_size, scale, soft_cap, window, ks_ptr, vs_ptr,
            TILE_N, D_PAD, USE_WINDOW, USE_SOFTCAP, DOT_FP32, PRECISION, QUANT,
        )
    if QUANT == 1:  # the values' sum back from the Hadamard basis
        acc = _hadamard16(acc, D_PAD)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # l = 0 only on padding rows
    tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _decode_kernel(
    out_ptr, part_acc_ptr, part_ml_ptr, q_ptr, k_cache_ptr, v_cache_ptr, ks_ptr, vs_ptr,
    block_tables_ptr, query_start_ptr, seq_lens_ptr, decode_seqs_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    stride_cb, stride_co, stride_ch,
    num_q_heads, head_size, block_size, scale, soft_cap, window,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
    TILE_N: tl.constexpr, D_PAD: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, QUANT: tl.constexpr,
):
    i = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(decode_seqs_ptr + i)
    row = tl.load(query_start_ptr + seq).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq)

    # Rows are the GROUP query heads that share this kv head, so K/V are read once for all.
    g = tl.arange(0, G_PAD)
    row_ok = g < GROUP
    head = kv_head * GROUP + g
    pos = tl.zeros([G_PAD], dtype=tl.int32) + (seq_len - 1)
    d = tl.arange(0, D_PAD)
    d_ok = d < head_size
    q = tl.load(q_ptr + row * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    elif QUANT == 0:
        q = q.to(k_cache_ptr.dtype.element_ty)
    if QUANT == 1:  # int8 keys and values are read in the Hadamard basis
        q = _hadamard16(q, D_PAD).to(q.dtype)

    # This split's share of the tiles that hold visible keys.
    kv_start = 0
    if USE_WINDOW:
        kv_start = tl.maximum(seq_len - window, 0)
    first_tile = kv_start // TILE_N
    n_tiles = tl.cdiv(seq_len, TILE_N) - first_tile
    per_split = tl.cdiv(n_tiles, NUM_SPLITS)
    tile_begin = first_tile + split * per_split
    tile_end = tl.minimum(tile_begin + per_split, first_tile + n_tiles)
    bt_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt

    acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
    m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    for tile in range(tile_begin, tile_end):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, pos, tile * TILE_N, seq_len, bt_row_ptr,
            k_cache_ptr, v_cache_ptr, stride_cb, stride_co, stride_ch,
            kv_head, block_size, head_size, scale, soft_cap, window, ks_ptr, vs_ptr,
            TILE_N, D_PAD, USE_WINDOW, USE_SOFTCAP, DOT_FP32, PRECISION, QUANT,
        )
    if QUANT == 1:  # the values' sum back from the Hadamard basis (partials too: linear)
        acc = _hadamard16(acc, D_PAD)

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + row * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        # Partials: acc [B_dec, Hq, NUM_SPLITS, D] and (m, l) [B_dec, Hq, NUM_SPLITS, 2].
        # An empty split stores m = -inf, l = 0, acc = 0, which the merge weighs as 0.
        cell = (i.to(tl.int64) * num_q_heads + head) * NUM_SPLITS + split  # [G_PAD]
        tl.store(part_acc_ptr + cell[:, None] * head_size + d[None, :], acc,
                 mask=row_ok[:, None] & d_ok[None, :])
        tl.store(part_ml_ptr + cell * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + cell * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _decode_reduce_kernel(
    out_ptr, part_acc_ptr, part_ml_ptr, query_start_ptr, decode_seqs_ptr,
    stride_ot, stride_oh, num_q_heads, head_size,
    NUM_SPLITS: tl.constexpr, S_PAD: tl.constexpr, D_PAD: tl.constexpr,
):
    i = tl.program_id(0)
    head = tl.program_id(1)
    row = tl.load(query_start_ptr + tl.load(decode_seqs_ptr + i)).to(tl.int64)
    s = tl.arange(0, S_PAD)
    s_ok = s < NUM_SPLITS
    cell = (i.to(tl.int64) * num_q_heads + head) * NUM_SPLITS + s
    m = tl.load(part_ml_ptr + cell * 2, mask=s_ok, other=float("-inf"))
    l_s = tl.load(part_ml_ptr + cell * 2 + 1, mask=s_ok, other=0.0)
    d = tl.arange(0, D_PAD)
    d_ok = d < head_size
    acc = tl.load(part_acc_ptr + cell[:, None] * head_size + d[None, :],
                  mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    # Every decode row sees its own key, so some split has a finite m and m_max is finite.
    m_max = tl.max(m, 0)
    w = tl.exp2(m - m_max)  # empty splits: exp2(-inf) = 0
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l_s * w, 0)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + d,
             out.to(out_ptr.dtype.element_ty), mask=d_ok)


# -- launchers ------------------------------------------------------------------------------


def _pow2(n: int, floor: int = 1) -> int:
    return max(floor, triton.next_power_of_2(n))


def _row_shrink(head_size: int, dtype: torch.dtype) -> int:
    """How many times wider than 256 bytes one padded K/V row is (at least 1).

    The default tiles are sized for 16-bit rows of 128 elements. Wider rows (float32 at
    head size 128, any dtype at 256) divide the key tile, and the prefill rows, by this
    factor so a program's tiles still fit in registers. Checked by compiling (no GPU
    needed) for sm_80, sm_90 and gfx942 at the cuda and rocm launch parameters: with the
    shrink, ptxas and the AMD backend report no spills for head sizes 64, 128, 256, GQA
    groups 1, 4, 8 and all three dtypes, except float32 at head size 64 with groups >= 4
    on sm_80 (224 bytes of stack); without it, head size 256 and float32 spilled.
    """
    row_bytes = _pow2(head_size, 16) * torch.finfo(dtype).bits // 8
    return max(1, row_bytes // 256)


def _dot_options(dtype: torch.dtype) -> tuple[bool, str | None]:
    """(DOT_FP32, PRECISION) for a cache dtype.

    Triton's interpreter multiplies the raw bits of bfloat16 ``tl.dot`` operands (it stores
    bfloat16 as uint16; triton-lang/triton#11584, unsupported upstream), so there bfloat16
    tiles are widened to float32 before each dot. Compiled kernels keep bfloat16 operands.
    """
    dot_fp32 = dtype == torch.float32 or (INTERPRETED and dtype == torch.bfloat16)
    return dot_fp32, ("ieee" if dot_fp32 else None)


def _cache_args(k_cache: torch.Tensor, v_cache: torch.Tensor, query: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int,
                           bool, str | None, torch.dtype]:
    """(k, v, k scales, v scales, QUANT, DOT_FP32, PRECISION, the tiles' dtype) for the
    attention launches. Quantised caches (int8; fp8 e4m3, passed as its bytes) come with
    float16 views of the same memory for their scales; float caches pass themselves there
    (unread)."""
    if k_cache.dtype == torch.int8 or k_cache.dtype == torch.float8_e4m3fn:
        quant = 1 if k_cache.dtype == torch.int8 else 2
        if quant == 2:
            k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        dot_fp32 = query.dtype == torch.float32 or INTERPRETED
        tiles = torch.float32 if dot_fp32 else query.dtype
        return (k_cache, v_cache, k_cache.view(torch.float16), v_cache.view(torch.float16),
                quant, dot_fp32, "ieee" if dot_fp32 else None, tiles)
    dot_fp32, precision = _dot_options(k_cache.dtype)
    return k_cache, v_cache, k_cache, v_cache, 0, dot_fp32, precision, k_cache.dtype


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    num_warps: int,
) -> None:
    """Scatter ``key``/``value`` [T, Hkv, D] into the caches at ``slot_mapping`` [T].

    ``slot_mapping`` entries < 0 are skipped. Head dims must be contiguous.
    """
    t, hkv, d = key.shape
    if t == 0:
        return
    _, block_size, _, _ = k_cache.shape
    _write_kv_kernel[(t,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        hkv, d, block_size,
        H_PAD=_pow2(hkv), D_PAD=_pow2(d), num_warps=num_warps,
    )


def prefill_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    qblock_seq: torch.Tensor,
    qblock_idx: torch.Tensor,
    *,
    block_q: int,
    max_rows: int,
    tile_n: int,
    scale: float,
    sliding_window: int | None,
    logits_soft_cap: float | None,
    num_warps: int,
    num_stages: int,
) -> None:
    """Attention of the query blocks ``qblock_seq``/``qblock_idx`` (``block_q`` tokens each).

    Writes the rows of those blocks into ``out`` [T, Hq, D]; other rows are untouched.
    One program takes ``block_q`` tokens times as many heads of a GQA group as fit in
    ``max_rows`` rows, so a large group is split into head chunks rather than growing the
    tile without bound. Rows wider than 256 bytes shrink ``max_rows`` and ``tile_n``
    (:func:`_row_shrink`).
    """
    num_qblocks = int(qblock_seq.shape[0])
    if num_qblocks == 0:
        return
    _, hq, d = query.shape
    _, block_size, hkv, _ = k_cache.shape
    group = hq // hkv
    k_cache, v_cache, ks, vs, quant, dot_fp32, precision, tiles = _cache_args(
        k_cache, v_cache, query)
    shrink = _row_shrink(d, tiles)
    tile_n = max(16, tile_n // shrink)
    heads = max(1, min(group, max_rows // shrink // block_q))
    grid = (num_qblocks, hkv * triton.cdiv(group, heads))
    _prefill_kernel[grid](
        out, query, k_cache, v_cache, ks, vs, block_tables,
        query_start_loc, seq_lens, qblock_seq, qblock_idx,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        d, block_size, scale, logits_soft_cap or 1.0, sliding_window or 0,
        GROUP=group, HEADS=heads, BLOCK_Q=block_q, BLOCK_M=_pow2(block_q * heads, 16),
        TILE_N=tile_n, D_PAD=_pow2(d, 16),
        USE_WINDOW=sliding_window is not None, USE_SOFTCAP=logits_soft_cap is not None,
        DOT_FP32=dot_fp32, PRECISION=precision, QUANT=quant, num_warps=num_warps,
        num_stages=num_stages,
    )


def decode_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    decode_seqs: torch.Tensor,
    *,
    num_splits: int,
    tile_n: int,
    scale: float,
    sliding_window: int | None,
    logits_soft_cap: float | None,
    num_warps: int,
    num_stages: int,
) -> None:
    """Attention of the one-token sequences ``decode_seqs``, each split ``num_splits`` ways.

    Writes those sequences' rows of ``out`` [T, Hq, D]. With ``num_splits > 1`` the partial
    results go through a float32 scratch buffer of ``B_dec * Hq * num_splits * (D + 2)``
    elements and a second kernel merges them.
    """
    num_dec = int(decode_seqs.shape[0])
    if num_dec == 0:
        return
    _, hq, d = query.shape
    _, block_size, hkv, _ = k_cache.shape
    group = hq // hkv
    k_cache, v_cache, ks, vs, quant, dot_fp32, precision, tiles = _cache_args(
        k_cache, v_cache, query)
    tile_n = max(16, tile_n // _row_shrink(d, tiles))
    if num_splits > 1:
        part_acc = torch.empty(num_dec, hq, num_splits, d, dtype=torch.float32, device=out.device)
        part_ml = torch.empty(num_dec, hq, num_splits, 2, dtype=torch.float32, device=out.device)
    else:  # unused by the kernel; any float32 tensor keeps the signature fixed
        part_acc = part_ml = out.new_empty(1, dtype=torch.float32)
    _decode_kernel[(num_dec, hkv, num_splits)](
        out, part_acc, part_ml, query, k_cache, v_cache, ks, vs, block_tables,
        query_start_loc, seq_lens, decode_seqs,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        hq, d, block_size, scale, logits_soft_cap or 1.0, sliding_window or 0,
        GROUP=group, G_PAD=_pow2(group, 16), NUM_SPLITS=num_splits,
        TILE_N=tile_n, D_PAD=_pow2(d, 16),
        USE_WINDOW=sliding_window is not None, USE_SOFTCAP=logits_soft_cap is not None,
        DOT_FP32=dot_fp32, PRECISION=precision, QUANT=quant, num_warps=num_warps,
        num_stages=num_stages,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(num_dec, hq)](
            out, part_acc, part_ml, query_start_loc, decode_seqs,
            out.stride(0), out.stride(1), hq, d,
            NUM_SPLITS=num_splits, S_PAD=_pow2(num_splits), D_PAD=_pow2(d),
            num_warps=num_warps,
        )
