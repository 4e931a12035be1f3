"""What an operator's service-level objectives are (``quire serve --slo-ttft``,
``--slo-e2e``).

Operators state SLOs as "120 concurrent at p95 TTFT 2.0 s", and ask how the longest
prompts fare: the metrics group requests by prompt-length band for that
(:mod:`quire.engine.prompt_bands`, which the core's KV figures share).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from quire.engine.prompt_bands import SMALLEST_BAND, band_of, prompt_len_bands

__all__ = ["SMALLEST_BAND", "SLOTargets", "band_of", "prompt_len_bands"]


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
