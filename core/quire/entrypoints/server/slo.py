"""What an operator's service-level objectives are, and how requests are grouped by prompt
length to track them.

Operators state SLOs as "120 concurrent at p95 TTFT 2.0 s", and ask how the longest
prompts fare: TTFT and queue delay grow with the prompt (prefill is linear in it, and a
long prompt waits for room in the KV pool), so one histogram over all prompts hides the
tail that matters. :func:`prompt_len_bands` cuts prompt lengths at powers of two, from
:data:`SMALLEST_BAND` up to ``max_model_len``: within a band prompts differ at most 2x,
so their prefill costs do too; the number of bands grows with log2 of the context (12
for 32K tokens), which keeps the series few; and the bands are the same on every server
of a given context length, so they can be summed across servers. Below
:data:`SMALLEST_BAND` tokens a prompt's prefill is dwarfed by a step's fixed cost, so
shorter prompts share one band.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

#: The upper bound of the first prompt-length band, in tokens.
SMALLEST_BAND = 16


@dataclass(frozen=True)
class SLOTargets:
    """The latency objectives ``quire serve`` counts misses of (``--slo-ttft``,
    ``--slo-e2e``); None: not tracked.

    :raises ValueError: naming the field whose value is not a finite number of seconds
        above 0.
    """

    #: Seconds from arrival to the first output token.
    ttft_s: float | None = None
    #: Seconds from arrival to the finish.
    e2e_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_s", "e2e_s"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not value > 0 or math.isinf(value):
                raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")

    @property
    def names(self) -> tuple[str, ...]:
        """The objectives set, as the ``slo`` label names them (``ttft``, ``e2e``)."""
        return tuple(n for n, v in (("ttft", self.ttft_s), ("e2e", self.e2e_s))
                     if v is not None)


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
    i = bisect.bisect_left(bands, prompt_len)
    return str(bands[min(i, len(bands) - 1)])
