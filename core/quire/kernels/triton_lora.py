"""Portable Triton kernels for the ``lora_linear`` op (:mod:`quire.ops.lora`): a batch's
per-token LoRA updates ``y[t, cols_i] += B[s, cols_i] @ (A[s, i] @ x[t])``, in the
Punica/BGMV shape (one program per token, each reading its own slot's weights).

Importing this module imports triton; :mod:`quire.kernels.triton_ops` imports it on the
op's first call. No vendor API: the same source compiles for any GPU Triton targets and
runs on CPU tensors under ``TRITON_INTERPRET=1`` (set before triton is imported).

Why BGMV rather than the reference's grouping by slot: the slots are read on the device,
so nothing is read back to the host (no ``unique``/``nonzero``) and a step is two
launches whatever the mix of adapters; a decode step, one token per sequence, is what
LoRA serving spends most launches on.

- ``_shrink_kernel``, grid ``(T, n_slices)``: ``v[t, i, :] = A[s, i] @ x[t]`` over tiles
  of ``BLOCK_K`` input features, the rank padded to ``R_PAD`` (a power of two, at least
  16) with masks; products summed in float32 registers (no ``tl.dot``, so no TF32 and no
  16-row minimum for one token). ``v`` is float32.
- ``_expand_kernel``, grid ``(T, cdiv(out, BLOCK_N))``: each column finds its slice
  among ``offsets``, ``delta = B[s, col, :] . v[t, slice, :]`` in float32, and
  ``y[t, col]`` becomes ``y + delta`` rounded once to y's dtype (columns before
  ``offsets[0]`` are left alone).

Tokens whose slot is -1 return at once in both kernels: their rows of ``y`` are not
touched. ``y`` is updated in place and returned. Numerics: float32 throughout, one
rounding to y's dtype at the end (the reference, in a half dtype, also rounds ``A x`` and
the delta); in the interpreter that rounding is done on the bits
(:func:`quire.kernels.triton_fused._round`), which otherwise truncates bfloat16.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

# whether the kernels run in Triton's interpreter, fixed at import
from quire.kernels.triton_attention import INTERPRETED
from quire.kernels.triton_fused import _round  # the interpreter's bfloat16 rounding, shared

#: The offsets of each (slices, device) as an int64 tensor there, made once: a step
#: calls the op once per targeted product, always with the same few offsets.
_OFFSETS: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, v_ptr, slots_ptr, in_features, rank,
    stride_xt, stride_xk, stride_as, stride_ai, stride_ar, stride_ak,
    stride_vt, stride_vi,
    R_PAD: tl.constexpr, BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1).to(tl.int64)
    slot = tl.load(slots_ptr + t)
    if slot < 0:  # the base model's token
        return
    offs_r = tl.arange(0, R_PAD)
    r_ok = offs_r < rank
    a_base = a_ptr + slot * stride_as + i * stride_ai + offs_r[:, None] * stride_ar
    acc = tl.zeros((R_PAD,), dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < in_features
        x = tl.load(x_ptr + t * stride_xt + offs_k * stride_xk, mask=k_ok, other=0.0)
        a = tl.load(a_base + offs_k[None, :] * stride_ak, mask=r_ok[:, None] & k_ok[None, :],
                    other=0.0)
        acc += tl.sum(a.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    tl.store(v_ptr + t * stride_vt + i * stride_vi + offs_r, acc)


@triton.jit
def _expand_kernel(
    y_ptr, b_ptr, v_ptr, slots_ptr, offsets_ptr, out_features, rank,
    stride_yt, stride_yn, stride_bs, stride_bn, stride_br, stride_vt, stride_vi,
    N_SLICES: tl.constexpr, R_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t)
    if slot < 0:
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    # each column's slice: how many slice starts it is at or past, less one
    piece = tl.zeros((BLOCK_N,), dtype=tl.int64) - 1
    for j in tl.static_range(N_SLICES):
        piece += (offs_n >= tl.load(offsets_ptr + j)).to(tl.int64)
    n_ok = (offs_n < out_features) & (piece >= 0)
    offs_r = tl.arange(0, R_PAD)
    mask = n_ok[:, None] & (offs_r < rank)[None, :]
    b = tl.load(b_ptr + slot * stride_bs + offs_n[:, None] * stride_bn
                + offs_r[None, :] * stride_br, mask=mask, other=0.0)
    v = tl.load(v_ptr + t * stride_vt + piece[:, None] * stride_vi + offs_r[None, :],
                mask=mask, other=0.0)
    delta = tl.sum(b.to(tl.float32) * v, axis=1)
    y_at = y_ptr + t * stride_yt + offs_n * stride_yn
    y = tl.load(y_at, mask=n_ok, other=0.0).to(tl.float32)
    out = _round(y + delta, y_ptr.dtype.element_ty, INTERPRETED)
    tl.store(y_at, out.to(y_ptr.dtype.element_ty), mask=n_ok)


def lora_linear(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                offsets: Sequence[int], token_slots: torch.Tensor, *, block_k: int = 64,
                block_n: int = 64) -> torch.Tensor:
    """:func:`quire.ops.lora.lora_linear` in two Triton kernels; ``y`` is updated in
    place and returned. Slots are not range-checked (that would read them back).

    :param block_k: input features per shrink step; :param block_n: output columns per
        expand program. Each a power of two.
    :raises ValueError: on shapes that do not fit the contract.
    :raises RuntimeError: for CPU tensors when triton was imported without the
        interpreter.
    """
    _check_shapes(y, x, a, b, offsets, token_slots)
    for name, size in (("block_k", block_k), ("block_n", block_n)):
        if size < 1 or size & (size - 1):
            raise ValueError(f"{name}={size} must be a power of two")
    if y.device.type == "cpu" and not INTERPRETED:
        raise RuntimeError("the triton lora_linear got CPU tensors, but triton was imported "
                           "without TRITON_INTERPRET=1; set it before triton is first "
                           "imported to run on CPU")
    tokens, out_features = y.shape
    num_slots, n_slices, rank, in_features = a.shape
    if tokens == 0 or rank == 0 or num_slots == 0:
        return y
    r_pad = max(16, triton.next_power_of_2(rank))
    slots = token_slots.to(device=y.device, dtype=torch.int64)
    v = torch.empty(tokens, n_slices, r_pad, dtype=torch.float32, device=y.device)
    _shrink_kernel[(tokens, n_slices)](
        x, a, v, slots, in_features, rank,
        x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2), a.stride(3),
        v.stride(0), v.stride(1),
        R_PAD=r_pad, BLOCK_K=block_k,
    )
    _expand_kernel[(tokens, triton.cdiv(out_features, block_n))](
        y, b, v, slots, _offsets_on(offsets, y.device), out_features, rank,
        y.stride(0), y.stride(1), b.stride(0), b.stride(1), b.stride(2),
        v.stride(0), v.stride(1),
        N_SLICES=n_slices, R_PAD=r_pad, BLOCK_N=block_n, INTERPRETED=INTERPRETED,
    )
    return y


def _check_shapes(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                  offsets: Sequence[int], token_slots: torch.Tensor) -> None:
    if y.dim() != 2 or x.dim() != 2 or a.dim() != 4 or b.dim() != 3:
        raise ValueError(f"expected y [T, out], x [T, in], a [S, n_slices, R, in], "
                         f"b [S, out, R]; got y {tuple(y.shape)}, x {tuple(x.shape)}, "
                         f"a {tuple(a.shape)}, b {tuple(b.shape)}")
    tokens, out_features = y.shape
    num_slots, n_slices, rank, in_features = a.shape
    if x.shape != (tokens, in_features) or b.shape != (num_slots, out_features, rank):
        raise ValueError(f"shapes do not agree: y {tuple(y.shape)}, x {tuple(x.shape)}, "
                         f"a {tuple(a.shape)}, b {tuple(b.shape)}")
    if token_slots.shape != (tokens,):
        raise ValueError(f"token_slots has shape {tuple(token_slots.shape)}, expected "
                         f"({tokens},)")
    if len(offsets) != n_slices:
        raise ValueError(f"{len(offsets)} offsets for {n_slices} slices")


def _offsets_on(offsets: Sequence[int], device: torch.device) -> torch.Tensor:
    key = (tuple(int(o) for o in offsets), device)
    found = _OFFSETS.get(key)
    if found is None:
        found = _OFFSETS[key] = torch.tensor(key[0], dtype=torch.int64, device=device)
    return found
