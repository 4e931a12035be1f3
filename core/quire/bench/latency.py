"""Latency of one request at a time: time to first token and inter-token latency.

Times are taken where the caller sees tokens (for Quire, when ``LLM.stream`` yields an
output holding more tokens than the last), by the rules of :class:`TokenClock`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from quire.bench.peers.clock import TokenClock
from quire.bench.peers.procmem import peak_rss_bytes, reset_peak_rss
from quire.bench.quire_engine import greedy_params
from quire.bench.stats import distribution
from quire.bench.workloads import BenchRequest
from quire.engine import LLMEngine
from quire.entrypoints.llm import LLM


@dataclass(frozen=True)
class RequestTiming:
    """One request's timeline, in seconds from its submission."""

    ttft_s: float
    e2e_s: float
    output_tokens: int
    #: Gaps between consecutive output tokens.
    itl_s: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class LatencyRun:
    """Every request of one pass, each run alone."""

    requests: list[RequestTiming]
    peak_rss_bytes: int | None = None

    def figures(self) -> dict[str, float]:
        ttft = [r.ttft_s for r in self.requests]
        itl = [gap for r in self.requests for gap in r.itl_s]
        e2e = [r.e2e_s for r in self.requests]
        figures = {**distribution("ttft_s", ttft, (50, 95)),
                   **distribution("itl_s", itl, (50, 95)),
                   **distribution("e2e_s", e2e, (50, 95))}
        decode_time = sum(sum(r.itl_s) for r in self.requests)
        if decode_time > 0:
            figures["decode_tokens_per_s"] = len(itl) / decode_time
        if self.peak_rss_bytes is not None:
            figures["peak_rss_mib"] = self.peak_rss_bytes / float(1 << 20)
        return figures


def run_quire(engine: LLMEngine, requests: list[BenchRequest]) -> LatencyRun:
    """Run each request alone through ``LLM.stream`` on ``engine`` (which must be idle)."""
    llm = LLM.from_engine(engine)
    reset_peak_rss(include_children=False)
    timings = []
    for request in requests:
        prompt = {"prompt_token_ids": list(request.prompt_token_ids)}
        clock = TokenClock()
        for out in llm.stream(prompt, greedy_params(request.output_len)):
            clock.observe(len(out.outputs[0].token_ids))
        timings.append(RequestTiming(**clock.timing()))
    return LatencyRun(timings, peak_rss_bytes(include_children=False))
