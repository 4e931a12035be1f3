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
- ``token_slots``: int64 [T], each token's slot, -1 for the base model.

The reference groups the tokens by slot: one shrink and one expand per slot present,
over its tokens only (the Punica/SGMV shape); a platform may replace it
(``OpSet.lora_linear``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def lora_linear(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                offsets: Sequence[int], token_slots: torch.Tensor) -> torch.Tensor:
    out = y.shape[-1]
    bounds = [*offsets[1:], out]
    for slot in torch.unique(token_slots).tolist():
        if slot < 0:
            continue
        rows = torch.nonzero(token_slots == slot).flatten()
        xs = x.index_select(0, rows).to(a.dtype)
        delta = torch.zeros(len(rows), out, dtype=a.dtype, device=y.device)
        for i, (start, end) in enumerate(zip(offsets, bounds)):
            delta[:, start:end] = (xs @ a[slot, i].T) @ b[slot, start:end].T
        y = y.index_add(0, rows, delta.to(y.dtype))
    return y
