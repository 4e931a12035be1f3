"""M-RoPE positions (Qwen2-VL and Qwen2.5-VL): three per token, for time, height and
width, as transformers' ``get_rope_index`` gives them for images.

================  ======================================================================
text token        three equal positions: its index in the sequence plus the shift of
                  the images before it (generated tokens are text)
image token       its (t, h, w) index in the image's grid (``MMItem.grid``), each added
                  to the text position where the image starts
after an image    the text moves on by ``max(h, w)`` positions, not by the image's
                  ``t * h * w`` tokens: each image shifts what follows by the difference
================  ======================================================================

The engine computes them per step (:func:`mrope_positions`), for any cut of a prompt
into chunks and for decode steps; the runner turns them into the model's [3, T] tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from quire.multimodal.inputs import MMItem


def mrope_positions(items: Sequence[MMItem], start: int, end: int) -> list[int]:
    """The positions of tokens ``start .. end`` of a sequence with ``items`` (each one
    run of placeholder tokens, in order): the time row, then the height row, then the
    width row, ``3 * (end - start)`` ints."""
    pos = np.tile(np.arange(start, end, dtype=np.int64), (3, 1))
    shift = 0  # of the text before the current image
    for item in items:
        offset, count = item.offset, item.num_embeds
        if offset >= end:
            break
        _, h, w = item.grid
        lo, hi = max(offset, start), min(offset + count, end)
        if lo < hi:
            k = np.arange(lo - offset, hi - offset)
            base = offset + shift
            pos[0, lo - start:hi - start] = base + k // (h * w)
            pos[1, lo - start:hi - start] = base + k // w % h
            pos[2, lo - start:hi - start] = base + k % w
        moved = max(h, w) - count
        pos[:, max(offset + count, start) - start:] += moved  # later images are set anew
        shift += moved
    return pos.ravel().tolist()


def check_mrope(request_id: str, items: Sequence[MMItem]) -> None:
    """Refuse images whose M-RoPE positions cannot be laid out: without a (t, h, w) grid
    of as many cells as placeholder tokens, in more than one run, or with more than one
    frame (videos).

    :raises ValueError: naming the request."""
    for item in items:
        grid = tuple(item.grid)
        if len(grid) != 3 or int(np.prod(grid)) != item.num_embeds:
            raise ValueError(f"request {request_id}: an image with {item.num_embeds} "
                             f"placeholder tokens has the M-RoPE grid {grid}")
        if len(item.runs) != 1:
            raise ValueError(f"request {request_id}: an M-RoPE image's placeholder tokens "
                             f"must be one run, got {len(item.runs)}")
        if grid[0] != 1:
            raise ValueError(f"request {request_id}: an image of {grid[0]} frames; video "
                             "is not supported")
