"""The mixture-of-experts reference ops: routing and the SiLU-gated experts.

``select_experts`` picks each token's experts the way Hugging Face's Qwen3-MoE and
Mixtral routers do (softmax in float32, then top-k, optionally renormalised).
``fused_moe`` runs the chosen experts grouped by expert: the token-slots (one per token
and choice) are sorted by expert id and each expert that got any runs one matmul over
its slots, so the work grows with ``T * top_k``, not with ``T * num_experts``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's ``top_k`` experts and their weights.

    ``softmax(router_logits)`` in float32, the ``top_k`` largest (ties as
    ``torch.topk``), divided by their sum when ``renormalize`` (Mixtral always,
    Qwen3-MoE when ``norm_topk_prob``).

    :param router_logits: [T, E], any float dtype.
    :returns: (weights float32 [T, top_k], expert ids int64 [T, top_k]).
    :raises ValueError: when ``router_logits`` is not 2-D or ``top_k`` is not in [1, E].
    """
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [T, E], got shape {tuple(router_logits.shape)}")
    num_experts = router_logits.shape[1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be between 1 and the {num_experts} experts")
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int64)


def check_moe_shapes(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                     weights: torch.Tensor, ids: torch.Tensor) -> None:
    """Shared by every ``fused_moe``: the shapes its contract names, or a ValueError
    naming the tensor that does not fit."""
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [T, H], got shape {tuple(hidden.shape)}")
    t, h = hidden.shape
    if w13.dim() != 3 or w13.shape[2] != h or w13.shape[1] % 2:
        raise ValueError(f"w13 must be [E, 2I, {h}], got shape {tuple(w13.shape)}")
    e, i = w13.shape[0], w13.shape[1] // 2
    if tuple(w2.shape) != (e, h, i):
        raise ValueError(f"w2 must be [{e}, {h}, {i}] to match w13, got {tuple(w2.shape)}")
    if ids.dim() != 2 or ids.shape[0] != t:
        raise ValueError(f"ids must be [{t}, top_k], got shape {tuple(ids.shape)}")
    if tuple(weights.shape) != tuple(ids.shape):
        raise ValueError(f"weights {tuple(weights.shape)} and ids {tuple(ids.shape)} differ")
    if ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ids must be int32 or int64, got {ids.dtype}")


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``sum_k weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t))``, ``e = ids[t, k]``.

    Expert ``e``'s gate and up projections are ``w13[e, :I]`` and ``w13[e, I:]``
    (``[out, in]``, as ``nn.Linear``), its down projection ``w2[e]``. The products run in
    the hidden dtype; each expert's output is multiplied by its weight in float32 and
    cast back (Mixtral's order), then the ``top_k`` outputs of a token are summed.

    :param hidden: [T, H]; :param w13: [E, 2I, H]; :param w2: [E, H, I];
    :param weights: [T, top_k] float32; :param ids: [T, top_k] int64, each in [0, E).
    :returns: [T, H] in the hidden dtype.
    :raises ValueError: on shapes that do not fit together, or an id outside [0, E).
    """
    check_moe_shapes(hidden, w13, w2, weights, ids)
    t, top_k = ids.shape
    num_experts = w13.shape[0]
    flat = ids.reshape(-1).to(torch.int64)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= num_experts):
        raise ValueError(f"expert ids must be in [0, {num_experts}), got "
                         f"[{int(flat.min())}, {int(flat.max())}]")
    # token-slots sorted by expert: slots[starts[e]:starts[e + 1]] are expert e's
    slots = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    tokens = hidden[slots // top_k]
    slot_weights = weights.reshape(-1)[slots].float()
    out = torch.empty(t * top_k, hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        end = start + count
        gate, up = F.linear(tokens[start:end], w13[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert])
        out[slots[start:end]] = (y.float() * slot_weights[start:end, None]).to(hidden.dtype)
        start = end
    return out.view(t, top_k, -1).sum(dim=1)
