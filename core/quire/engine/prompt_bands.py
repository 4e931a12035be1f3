"""Prompt-length bands: how requests are grouped by prompt length wherever their
figures are tracked apart (TTFT and queue time in the server's metrics, KV pages in the
core's stats).

Operators ask how the longest prompts fare: TTFT, queue delay and KV use grow with the
prompt (prefill is linear in it, and a long prompt waits for room in the KV pool), so one
figure over all prompts hides the tail that matters. :func:`prompt_len_bands` cuts prompt
lengths at powers of two, from :data:`SMALLEST_BAND` up to ``max_model_len``: within a
band prompts differ at most 2x, so their prefill costs do too; the number of bands grows
with log2 of the context (12 for 32K tokens), which keeps the series few; and the bands
are the same on every server of a given context length, so they can be summed across
servers. Below :data:`SMALLEST_BAND` tokens a prompt's prefill is dwarfed by a step's
fixed cost, so shorter prompts share one band.
"""

from __future__ import annotations

import bisect

#: The upper bound of the first prompt-length band, in tokens.
SMALLEST_BAND = 16


def prompt_len_bands(max_model_len: int) -> list[int]:
    """The bands' upper bounds: 16, 32, 64, ... below ``max_model_len``, then
    ``max_model_len`` itself (a prompt is never longer).

    :raises ValueError: for ``max_model_len`` < 1.
    """
    if max_model_len < 1:
        raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
    bounds = []
    bound = SMALLEST_BAND
    while bound < max_model_len:
        bounds.append(bound)
        bound *= 2
    bounds.append(max_model_len)
    return bounds


def band_of(prompt_len: int, bands: list[int]) -> str:
    """The label of ``prompt_len``'s band: the smallest bound at or above it (the last
    for a longer prompt, which no engine admits)."""
    return str(bands[band_index(prompt_len, bands)])


def band_index(prompt_len: int, bands: list[int]) -> int:
    """The position in ``bands`` of ``prompt_len``'s band (:func:`band_of`'s)."""
    return min(bisect.bisect_left(bands, prompt_len), len(bands) - 1)
