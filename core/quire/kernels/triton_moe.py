"""Portable Triton kernels for a fused mixture-of-experts layer, and their launcher.

Importing this module imports triton; :mod:`quire.kernels.triton_moe_op` imports it on
the op's first call. No vendor API: the same source compiles for any GPU Triton targets
and runs on CPU tensors under ``TRITON_INTERPRET=1`` (set before triton is imported).

The computation is :func:`quire.ops.moe.fused_moe`'s, in three steps:

1. :func:`align_slots` (torch): the ``T * top_k`` token-slots (slot ``s`` is token
   ``s // top_k``'s choice ``s % top_k``) sorted by expert, each expert's run padded to a
   multiple of ``BLOCK_M`` with the sentinel ``T * top_k``, so every block of ``BLOCK_M``
   sorted slots belongs to one expert. The grid is sized by an upper bound on the block
   count, so nothing waits for the device; blocks past the real count have expert -1.
2. ``_gate_up_kernel``, grid ``(blocks, cdiv(I, BLOCK_N))``: one block's tokens times its
   expert's gate and up rows (two accumulators), ``silu(gate) * up`` written per slot.
3. ``_down_kernel``, grid ``(blocks, cdiv(H, BLOCK_N))``: those rows times the expert's
   down projection, scaled by the slot's routing weight, written per slot; the ``top_k``
   slots of each token are then summed (torch).

Numerics: accumulators are float32; float32 operands use ``input_precision="ieee"``
(never TF32). The SiLU is taken in float32 and the gated rows are stored in the hidden
dtype, as the reference does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# whether the kernels run in Triton's interpreter, fixed at import
from quire.kernels.triton_attention import INTERPRETED
from quire.ops.moe import check_moe_shapes


@triton.jit
def _gate_up_kernel(
    x_ptr, w13_ptr, out_ptr, slots_ptr, block_expert_ptr,
    num_slots, hidden_size, inter_size,
    stride_xt, stride_we, stride_wn, stride_ot,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:  # a block past the last expert's run
        return
    slots = tl.load(slots_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = slots < num_slots
    tokens = slots // TOP_K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter_size
    w_base = w13_ptr + expert * stride_we
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden_size, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < hidden_size
        x = tl.load(x_ptr + tokens[:, None] * stride_xt + offs_k[None, :],
                    mask=valid[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & n_ok[None, :]
        # [BLOCK_K, BLOCK_N] tiles of the gate rows and of the up rows (I further down)
        w_gate = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None],
                         mask=w_mask, other=0.0)
        w_up = tl.load(w_base + (inter_size + offs_n[None, :]) * stride_wn + offs_k[:, None],
                       mask=w_mask, other=0.0)
        if DOT_FP32:
            x = x.to(tl.float32)
            w_gate = w_gate.to(tl.float32)
            w_up = w_up.to(tl.float32)
        acc_gate += tl.dot(x, w_gate, input_precision=PRECISION)
        acc_up += tl.dot(x, w_up, input_precision=PRECISION)
    gated = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up
    tl.store(out_ptr + slots[:, None] * stride_ot + offs_n[None, :],
             gated.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(
    h_ptr, w2_ptr, out_ptr, weights_ptr, slots_ptr, block_expert_ptr,
    num_slots, hidden_size, inter_size,
    stride_ht, stride_we, stride_wn, stride_ot,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    slots = tl.load(slots_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = slots < num_slots
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden_size
    w_base = w2_ptr + expert * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter_size, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < inter_size
        h = tl.load(h_ptr + slots[:, None] * stride_ht + offs_k[None, :],
                    mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None],
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if DOT_FP32:
            h = h.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(h, w, input_precision=PRECISION)
    # the product is rounded to the hidden dtype before the weight, as the reference does
    acc = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weights_ptr + slots, mask=valid, other=0.0)
    tl.store(out_ptr + slots[:, None] * stride_ot + offs_n[None, :],
             (acc * weight[:, None]).to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & n_ok[None, :])


def align_slots(ids: torch.Tensor, num_experts: int, block_m: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-slots sorted by expert, each expert's run padded to whole blocks.

    :param ids: [T, top_k] expert ids in [0, E).
    :returns: (slots int64 [blocks * block_m]: slot indices, ``T * top_k`` in padding;
        block_expert int64 [blocks]: each block's expert, -1 past the last run). ``blocks``
        is an upper bound (``cdiv(T * top_k, block_m) + min(E, T * top_k)``), so no value
        is read back from the device.
    """
    flat = ids.reshape(-1).to(torch.int64)
    n = flat.numel()
    dev = flat.device
    max_blocks = -(-n // block_m) + min(num_experts, n)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    # a slot's place: its expert's padded start plus its rank among that expert's slots
    run_start = torch.cumsum(counts, 0) - counts
    rank = torch.arange(n, device=dev) - run_start[sorted_experts]
    place = (padded_end - padded)[sorted_experts] + rank
    slots = torch.full((max_blocks * block_m,), n, dtype=torch.int64, device=dev)
    slots[place] = order
    block_starts = torch.arange(max_blocks, device=dev) * block_m
    block_expert = torch.searchsorted(padded_end, block_starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return slots, block_expert


def _dot_mode(dtype: torch.dtype) -> tuple[bool, str | None]:
    """(DOT_FP32, PRECISION): float32 products in IEEE precision; bfloat16 widened in the
    interpreter, whose bfloat16 ``tl.dot`` multiplies raw bits (triton-lang/triton#11584)."""
    dot_fp32 = dtype == torch.float32 or (INTERPRETED and dtype == torch.bfloat16)
    return dot_fp32, ("ieee" if dot_fp32 else None)


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              weights: torch.Tensor, ids: torch.Tensor, *, block_m: int = 16,
              block_n: int = 64, block_k: int = 32) -> torch.Tensor:
    """:func:`quire.ops.moe.fused_moe` in the Triton kernels; same contract, except that
    expert ids are not range-checked (that would read them back from the device).

    :param block_m: token-slots per program (each expert's run is padded to it).
    :param block_n: output columns per program; :param block_k: reduction step. Each at
        least 16 (``tl.dot``'s minimum) and a power of two.
    :raises ValueError: on shapes that do not fit, a strided last dimension, or block
        sizes ``tl.dot`` cannot take.
    :raises RuntimeError: for CPU tensors when triton was imported without the interpreter.
    """
    check_moe_shapes(hidden, w13, w2, weights, ids)
    for name, b in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        if b < 16 or b & (b - 1):
            raise ValueError(f"{name}={b} must be a power of two of at least 16")
    for name, t in (("hidden", hidden), ("w13", w13), ("w2", w2)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}'s last dimension must be contiguous (stride 1)")
    if hidden.device.type == "cpu" and not INTERPRETED:
        raise RuntimeError("the triton fused_moe got CPU tensors, but triton was imported "
                           "without TRITON_INTERPRET=1; set it before triton is first "
                           "imported to run on CPU")
    t, top_k = ids.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    h_size = hidden.shape[1]
    n = t * top_k
    if n == 0:
        return torch.zeros_like(hidden)
    slots, block_expert = align_slots(ids, num_experts, block_m)
    blocks = block_expert.numel()
    dot_fp32, precision = _dot_mode(hidden.dtype)
    gated = torch.empty(n, inter, dtype=hidden.dtype, device=hidden.device)
    _gate_up_kernel[(blocks, triton.cdiv(inter, block_n))](
        hidden, w13, gated, slots, block_expert, n, h_size, inter,
        hidden.stride(0), w13.stride(0), w13.stride(1), gated.stride(0),
        TOP_K=top_k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_FP32=dot_fp32, PRECISION=precision,
    )
    per_slot = torch.empty(n, h_size, dtype=hidden.dtype, device=hidden.device)
    slot_weights = weights.reshape(-1).to(torch.float32).contiguous()
    _down_kernel[(blocks, triton.cdiv(h_size, block_n))](
        gated, w2, per_slot, slot_weights, slots, block_expert, n, h_size, inter,
        gated.stride(0), w2.stride(0), w2.stride(1), per_slot.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_FP32=dot_fp32, PRECISION=precision,
    )
    return per_slot.view(t, top_k, h_size).sum(dim=1)
