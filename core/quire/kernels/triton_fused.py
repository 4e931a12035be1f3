"""Portable Triton kernels for the elementwise ops a decoder layer runs between its
products: RMSNorm with the residual add folded in, and the gated activations.

Importing this module imports triton; :mod:`quire.kernels.triton_ops` imports it on an
op's first call. No vendor API: the same source compiles for any GPU Triton targets and
runs on CPU tensors under ``TRITON_INTERPRET=1`` (set before triton is imported).

Kernels (one program = one Triton program instance):

- ``_rms_norm_kernel``, grid ``(rows,)``: one row of ``H`` in one tile; with a residual,
  also stores ``x + residual`` (the new residual stream) in the same pass.
- ``_gated_kernel``, grid ``(rows, cdiv(I, BLOCK))``: ``act(gate) * up`` for one tile of
  one row, the activation chosen at compile time (SiLU or tanh-GELU).

Numerics follow :mod:`quire.ops.reference` step by step, so half-precision results round
where the reference rounds: statistics and activations in float32; the residual sum,
the normalised value (without offset) and the activation are rounded to the input dtype
before the next product, as torch does between its operators.
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
