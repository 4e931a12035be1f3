"""Portable Triton kernels for the elementwise ops a decoder layer runs between its
products: RMSNorm with the residual add folded in, the gated activations, and the rotary
embedding fused with the KV-page write.

Importing this module imports triton; :mod:`quire.kernels.triton_ops` imports it on an
op's first call. No vendor API: the same source compiles for any GPU Triton targets and
runs on CPU tensors under ``TRITON_INTERPRET=1`` (set before triton is imported).

Kernels (one program = one Triton program instance):

- ``_rms_norm_kernel``, grid ``(rows,)``: one row of ``H`` in one tile; with a residual,
  also stores ``x + residual`` (the new residual stream) in the same pass.
- ``_gated_kernel``, grid ``(rows, cdiv(I, BLOCK))``: ``act(gate) * up`` for one tile of
  one row, the activation chosen at compile time (SiLU or tanh-GELU).
- ``_rotary_write_kv_kernel``, grid ``(T,)``: one token's query and key heads rotated
  (rotate-half pairs read straight from memory), the queries stored, the keys and the
  values stored into the token's KV slot: the rotation and the KV write in one pass.

Numerics follow :mod:`quire.ops.reference` step by step, so half-precision results round
where the reference rounds: statistics and activations in float32; the residual sum,
the normalised value (without offset) and the activation are rounded to the input dtype
before the next product, as torch does between its operators.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# whether the kernels run in Triton's interpreter, fixed at import
from quire.kernels.triton_attention import INTERPRETED

#: Largest row the one-tile norm takes: 64k elements of float32 in one program.
MAX_NORM_SIZE = 65536
#: Activation codes for ``_gated_kernel``'s ``ACT``.
SILU, GELU_TANH = 0, 1


# -- kernels --------------------------------------------------------------------------------


@triton.jit
def _round(x, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """float32 ``x`` rounded to ``dtype`` (to nearest, ties to even), kept in float32.

    Triton's interpreter truncates float32 to bfloat16 instead of rounding, so there the
    rounding is done on the bits (finite values; a NaN may come out as another NaN or
    an infinity). Compiled kernels, and other dtypes, cast natively.
    """
    if INTERPRETED and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    return x.to(dtype).to(tl.float32)


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr,
    stride_x, stride_r, stride_o, stride_s,
    size, eps, offset,
    HAS_RESIDUAL: tl.constexpr, HAS_OFFSET: tl.constexpr, BLOCK: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < size
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        # one add, rounded to the dtype as torch's add is
        h = _round(r.to(tl.float32) + x.to(tl.float32), x.dtype, INTERPRETED)
        tl.store(sum_ptr + row * stride_s + cols, h.to(x.dtype), mask=mask)
    else:
        h = x.to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(h * h, axis=0) / size + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_OFFSET:  # Gemma: the product in float32, cast once
        y = h * inv * (offset + w)
    else:  # Llama: normalised value cast to the dtype before the weight multiplies it
        y = _round(h * inv, x.dtype, INTERPRETED) * w
    y = _round(y, out_ptr.dtype.element_ty, INTERPRETED).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, y, mask=mask)


@triton.jit
def _gated_kernel(
    x_ptr, out_ptr, stride_x, stride_o, inter,
    ACT: tl.constexpr, BLOCK: tl.constexpr, INTERPRETED: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    if ACT == 0:  # silu
        a = g / (1.0 + tl.exp(-g))
    else:  # gelu, tanh approximation; tanh(z) = 1 - 2 / (exp(2z) + 1), finite for any z
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        a = 0.5 * g * (2.0 - 2.0 / (tl.exp(2.0 * z) + 1.0))
    a = _round(a, gate.dtype, INTERPRETED)  # the activation is its own op in the reference
    out = _round(a * up.to(tl.float32), gate.dtype, INTERPRETED)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_write_kv_kernel(
    qk_ptr, v_ptr, cos_ptr, sin_ptr, q_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_qkt, stride_qkh, stride_vt, stride_vh, stride_cos, stride_sin,
    stride_qt, stride_qh, stride_cb, stride_co, stride_ch,
    num_heads, num_kv_heads, head_size, block_size,
    H_PAD: tl.constexpr, HKV_PAD: tl.constexpr, D_PAD: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, H_PAD)[:, None]
    d = tl.arange(0, D_PAD)[None, :]
    half = head_size // 2
    partner = tl.where(d < half, d + half, d - half)  # roll by D/2: i pairs with i + D/2
    heads = (h < num_heads + num_kv_heads) & (d < head_size)
    row = qk_ptr + t * stride_qkt + h * stride_qkh
    x = tl.load(row + d, mask=heads, other=0.0)
    xr = tl.load(row + partner, mask=heads, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + t * stride_cos + d, mask=d < head_size, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_sin + d, mask=d < head_size, other=0.0).to(tl.float32)
    # the reference's three rounded operations, in x's dtype: x * cos, roll(x) * sin, sum
    a = _round(x.to(tl.float32) * c, x.dtype, INTERPRETED)
    b = _round(xr * s, x.dtype, INTERPRETED)
    out = _round(a + b, x.dtype, INTERPRETED).to(x.dtype)
    tl.store(q_ptr + t * stride_qt + h * stride_qh + d, out, mask=heads & (h < num_heads))
    # keys (heads num_heads..) and values to the token's slot; a negative slot is padding
    slot = tl.load(slot_ptr + t).to(tl.int64)
    page = (slot // block_size) * stride_cb + (slot % block_size) * stride_co
    kh = h - num_heads
    written = heads & (h >= num_heads) & ((kh * 0 + slot) >= 0)
    tl.store(k_cache_ptr + page + kh * stride_ch + d, out, mask=written)
    vh = tl.arange(0, HKV_PAD)[:, None]
    vmask = (vh < num_kv_heads) & (d < head_size) & ((vh * 0 + slot) >= 0)
    val = tl.load(v_ptr + t * stride_vt + vh * stride_vh + d, mask=vmask)
    tl.store(v_cache_ptr + page + vh * stride_ch + d, val, mask=vmask)


# -- launchers ------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, *, offset: float = 0.0
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`quire.ops.reference.rms_norm` in one kernel launch.

    :raises ValueError: naming the shapes when ``weight`` or ``residual`` does not fit
        ``x``, or the row is longer than :data:`MAX_NORM_SIZE`.
    """
    size = x.shape[-1]
    if weight.shape != (size,):
        raise ValueError(f"rms_norm: weight of shape {tuple(weight.shape)} for rows of {size}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"rms_norm: residual {tuple(residual.shape)} {residual.dtype} "
                         f"must match x {tuple(x.shape)} {x.dtype}")
    if size > MAX_NORM_SIZE:
        raise ValueError(f"rms_norm: rows of {size} exceed the one-tile kernel's "
                         f"{MAX_NORM_SIZE}")
    _check_host(x)
    rows = _rows(x)
    out = torch.empty(x.shape, dtype=_out_dtype(x, weight, offset), device=x.device)
    res = _rows(residual) if residual is not None else rows
    new_residual = torch.empty_like(x) if residual is not None else out
    n = rows.shape[0]
    if n:
        flat_sum = new_residual.view(-1, size)
        _rms_norm_kernel[(n,)](
            rows, res, weight.contiguous(), out.view(-1, size), flat_sum,
            rows.stride(0), res.stride(0), size, flat_sum.stride(0),
            size, float(eps), float(offset),
            HAS_RESIDUAL=residual is not None, HAS_OFFSET=bool(offset),
            BLOCK=triton.next_power_of_2(size), INTERPRETED=INTERPRETED,
            num_warps=_warps(size),
        )
    return (out, new_residual) if residual is not None else out


def gated(x: torch.Tensor, activation: int) -> torch.Tensor:
    """[..., 2I] -> [..., I]: ``act(x[..., :I]) * x[..., I:]``, ``activation`` one of
    :data:`SILU`, :data:`GELU_TANH`.

    :raises ValueError: when the last dimension is odd.
    """
    width = x.shape[-1]
    if width % 2:
        raise ValueError(f"gated activation: last dimension {width} is odd; expected "
                         "gate and up halves")
    _check_host(x)
    inter = width // 2
    rows = _rows(x)
    out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype, device=x.device)
    n = rows.shape[0]
    if n and inter:
        block = min(1024, triton.next_power_of_2(inter))
        _gated_kernel[(n, triton.cdiv(inter, block))](
            rows, out.view(-1, inter), rows.stride(0), inter, inter,
            ACT=activation, BLOCK=block, INTERPRETED=INTERPRETED, num_warps=_warps(block),
        )
    return out


def rotary_write_kv(qk: torch.Tensor, value: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, kv_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> torch.Tensor:
    """:func:`quire.ops.reference.rotary_write_kv` in one kernel launch; in addition,
    an entry < 0 in ``slot_mapping`` (a padding token) is not written, as in the Triton
    backend's own KV write.

    :raises ValueError: naming the shapes when ``qk``, ``value``, ``cos``/``sin`` or the
        cache do not fit together, or the cache's dtype differs from the inputs'.
    """
    if kv_cache.dtype in (torch.int8, torch.float8_e4m3fn):
        # quantised pages (rows of D + D / 8 with their scales): the rotation and the
        # quantising write in torch (quire.ops.kv_quant); every slot must be >= 0 (no
        # padding rows: the engine captures no decode graphs with quantised pages)
        from quire.ops.reference import rotary_write_kv as reference_rotary_write_kv

        return reference_rotary_write_kv(qk, value, cos, sin, kv_cache, slot_mapping)
    t, heads, d = qk.shape
    hkv = value.shape[1]
    if value.shape != (t, hkv, d) or heads <= hkv or d % 2:
        raise ValueError(f"rotary_write_kv: qk {tuple(qk.shape)} and value "
                         f"{tuple(value.shape)} are not [T, Hq + Hkv, D] and [T, Hkv, D] "
                         "with an even D")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[3:] != (hkv, d):
        raise ValueError(f"rotary_write_kv: kv_cache {tuple(kv_cache.shape)} is not "
                         f"[2, num_blocks, block_size, {hkv}, {d}]")
    if not qk.dtype == value.dtype == kv_cache.dtype:
        raise ValueError(f"rotary_write_kv: qk {qk.dtype}, value {value.dtype} and the "
                         f"cache {kv_cache.dtype} must share one dtype")
    for name, f in (("cos", cos), ("sin", sin)):
        if f.shape[0] != t or f.shape[-1] != d or f.numel() != t * d:
            raise ValueError(f"rotary_write_kv: {name} {tuple(f.shape)} is not [T, 1, D]")
    _check_host(qk)
    query = torch.empty(t, heads - hkv, d, dtype=qk.dtype, device=qk.device)
    if t == 0:
        return query
    qk, value = _dense_last(qk), _dense_last(value)
    cos, sin = _dense_last(cos), _dense_last(sin)
    if kv_cache.stride(-1) != 1:
        raise ValueError("rotary_write_kv: the cache's head dim must be contiguous")
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _rotary_write_kv_kernel[(t,)](
        qk, value, cos, sin, query, k_cache, v_cache, slot_mapping,
        qk.stride(0), qk.stride(1), value.stride(0), value.stride(1),
        cos.stride(0), sin.stride(0), query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        heads - hkv, hkv, d, k_cache.shape[1],
        H_PAD=triton.next_power_of_2(heads), HKV_PAD=triton.next_power_of_2(hkv),
        D_PAD=triton.next_power_of_2(d), INTERPRETED=INTERPRETED,
        num_warps=_warps(triton.next_power_of_2(heads) * triton.next_power_of_2(d)),
    )
    return query


def _dense_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[rows, last]`` with unit stride along the last dimension (a view when
    possible; a copy for layouts a single row stride cannot describe)."""
    if x.dim() >= 1 and x.shape[-1] > 1 and x.stride(-1) != 1:
        x = x.contiguous()
    return x.reshape(-1, x.shape[-1])


def _out_dtype(x: torch.Tensor, weight: torch.Tensor, offset: float) -> torch.dtype:
    # the reference's result dtype: with an offset the input's; without, the product
    # ``weight * normalised`` promotes as torch promotes
    return x.dtype if offset else torch.promote_types(x.dtype, weight.dtype)


def _warps(block: int) -> int:
    return 1 if block <= 512 else 4 if block <= 4096 else 8


def _check_host(x: torch.Tensor) -> None:
    if x.device.type == "cpu" and not INTERPRETED:
        raise RuntimeError("the Triton kernels got CPU tensors, but triton was imported "
                           "without TRITON_INTERPRET=1; set it before triton is first "
                           "imported, or pass device tensors")
