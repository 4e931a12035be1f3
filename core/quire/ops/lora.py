"""The LoRA op: a batch's per-token adapter updates added to a product's output.

``lora_linear(y, x, a, b, offsets, token_slots)`` returns ``y`` with, for each token
``t`` whose slot ``s = token_slots[t]`` is not -1 and each slice ``i`` of the product's
output (columns ``offsets[i]`` up to the next offset, or the end),
``y[t, cols_i] += b[s, cols_i] @ (a[s, i] @ x[t])``:

- ``y``: [T, out] the base product's output (any float dtype; changed in place or not:
  use the returned tensor);
- ``x``: [T, in] its input;
- ``a``: [S, n_slices, R, in] each slot's A per slice, zero-padded to rank R;
- ``b``: [S, out, R] each slot's B (with its scaling folded in), slices side by side;
- ``offsets``: the first column of each slice (a fused q/k/v or gate/up product has one
  slice per module it holds);
- ``token_slots``: int64 [T], each token's slot, -1 for the base model;
- ``segments``: optionally the same grouping made once per step by the caller
  (:func:`segments_of`), which the reference then need not redo per product; an
  implementation that reads ``token_slots`` itself may ignore it.

The reference groups the tokens by slot: one gather of the adapters' tokens, then per
slot one shrink over every slice at once and one expand per slice, over its tokens only
(the Punica/SGMV shape), and one scatter back; a platform may replace it
(``OpSet.lora_linear``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Segments = tuple[torch.Tensor, tuple[tuple[int, int, int], ...]]


def segments_of(token_slots: torch.Tensor) -> Segments:
    """The tokens with a slot, ordered by slot (their rows), and each slot's (slot,
    start, end) in that order."""
    order = torch.argsort(token_slots, stable=True)
    sorted_slots = token_slots[order]
    keep = sorted_slots >= 0
    order, sorted_slots = order[keep], sorted_slots[keep]
    slots, counts = torch.unique_consecutive(sorted_slots, return_counts=True)
    bounds, start = [], 0
    for slot, count in zip(slots.tolist(), counts.tolist()):
        bounds.append((slot, start, start + count))
        start += count
    return order, tuple(bounds)


def lora_linear(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                offsets: Sequence[int], token_slots: torch.Tensor,
                segments: Segments | None = None) -> torch.Tensor:
    order, bounds = segments if segments is not None else segments_of(token_slots)
    if not bounds:
        return y
    out = y.shape[-1]
    ends = [*offsets[1:], out]
    n_slices, rank = a.shape[1], a.shape[2]
    xs = x.index_select(0, order).to(a.dtype)
    delta = torch.zeros(len(order), out, dtype=a.dtype, device=y.device)
    for slot, start, end in bounds:
        shrunk = xs[start:end] @ a[slot].reshape(n_slices * rank, -1).T  # [n, slices*R]
        for i, (first, last) in enumerate(zip(offsets, ends)):
            delta[start:end, first:last] = \
                shrunk[:, i * rank : (i + 1) * rank] @ b[slot, first:last].T
    return y.index_add(0, order, delta.to(y.dtype))
