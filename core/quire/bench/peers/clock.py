"""Token arrival times of one request: TTFT, inter-token gaps, end-to-end latency.

Standard library only, shared by Quire's own measurements and the peer workers, so that
every engine is timed by the same rules: the clock starts when the request is handed
over; the first token's wait is the TTFT; when one arrival brings several tokens, its gap
is split evenly among them, so a request of N tokens has N - 1 inter-token gaps.
"""

from __future__ import annotations

import time
from typing import Any


class TokenClock:
    """Call :meth:`observe` with the running token count whenever tokens arrive."""

    def __init__(self, start: float | None = None) -> None:
        self.start = time.perf_counter() if start is None else start
        self.last = self.start
        self.first: float | None = None
        self.count = 0
        self.gaps: list[float] = []

    def observe(self, total_tokens: int, now: float | None = None) -> None:
        """``total_tokens`` have arrived so far, the newest at ``now`` (default: now)."""
        now = time.perf_counter() if now is None else now
        new = total_tokens - self.count
        if new <= 0:
            return
        if self.first is None:
            self.first = now
            new -= 1
        if new > 0:
            self.gaps.extend([(now - self.last) / new] * new)
        self.last, self.count = now, total_tokens

    def timing(self) -> dict[str, Any]:
        if self.first is None:
            raise RuntimeError("the request produced no token")
        return {"ttft_s": self.first - self.start, "e2e_s": self.last - self.start,
                "output_tokens": self.count, "itl_s": self.gaps}
