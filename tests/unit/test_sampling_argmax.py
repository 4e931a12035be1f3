"""quire.sampling.argmax.row_argmax against torch.argmax: the same index for every row.

Random float32 logits (never zeros), rows with ties (the first occurrence must win),
a maximum in a short last chunk or in its last position, NaNs (argmax's maximum),
rows of -inf, widths below, at and around multiples of the chunk, and strided input;
each many rows at a time and a few (numpy's path).
"""

from __future__ import annotations

import pytest
import torch
from quire.sampling.argmax import CHUNK, NUMPY_ROWS, row_argmax


@pytest.mark.parametrize("width", [5, 4 * CHUNK - 1, 4 * CHUNK, 4 * CHUNK + 1, 49152,
                                   151936, 32000])
def test_random_rows_match_torch(width: int) -> None:
    gen = torch.Generator().manual_seed(width)
    x = torch.randn(37, width, generator=gen) * 4
    assert torch.equal(row_argmax(x), x.argmax(dim=-1))
    few = x[:NUMPY_ROWS]
    assert torch.equal(row_argmax(few), few.argmax(dim=-1))


@pytest.mark.parametrize("rows", [9, NUMPY_ROWS, 1])
def test_ties_nans_infinities_and_the_short_last_chunk(rows: int) -> None:
    width = 10 * CHUNK + 300
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(9, width, generator=gen)
    x[0, [17, 5 * CHUNK - 120, 9 * CHUNK - 216]] = 50.0  # a tie: the first wins
    x[1, [CHUNK - 1, CHUNK]] = 50.0               # a tie across a chunk border
    x[2, width - 1] = 50.0                        # the last logit of a short chunk
    x[3, width - 150] = 50.0                      # inside the short chunk
    x[4, [300, 7 * CHUNK - 168]] = float("nan")  # NaN is argmax's maximum
    x[5] = float("-inf")                          # nothing above -inf: index 0
    x[6, 3 * CHUNK + 7] = float("inf")
    x[7, [2, width - 2]] = float("inf")
    x[8, width - 1] = float("nan")
    # the same rows a few at a time too: those go to numpy's argmax
    for at in range(0, 9, rows):
        part = x[at:at + rows]
        assert torch.equal(row_argmax(part), part.argmax(dim=-1))


def test_strided_and_empty_input() -> None:
    x = torch.randn(64, 2 * 49152)[:, ::2]
    assert not x.is_contiguous()
    assert torch.equal(row_argmax(x), x.argmax(dim=-1))
    assert torch.equal(row_argmax(x[:1]), x[:1].argmax(dim=-1))
    empty = torch.empty(0, 49152)
    assert row_argmax(empty).shape == (0,)
