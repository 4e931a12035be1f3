"""Offline throughput: every request of a workload submitted at once, run to completion.

The figures of one run come from :class:`ThroughputRun`, which Quire's run and each peer
worker's result fill alike. Quire's run drives the engine the way ``LLM.generate`` does
(add every request, step until none is left), and also reads the KV pages in use after
each step, which ``LLM.generate`` does not expose.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from quire.bench.peers.procmem import peak_rss_bytes, reset_peak_rss
from quire.bench.quire_engine import greedy_params, kv_page_bytes
from quire.bench.workloads import BenchRequest
from quire.engine import LLMEngine
from quire.lora.request import LoRARequest
from quire.structured.params import StructuredOutputsParams

_MIB = float(1 << 20)


@dataclass(frozen=True)
class ThroughputRun:
    """What one timed run did. Peaks are None where they could not be read."""

    elapsed_s: float
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    #: Resident-set high-water mark during the run (VmHWM, summed over child processes).
    peak_rss_bytes: int | None = None
    #: KV pages in use at the fullest step, in bytes (Quire only).
    peak_kv_bytes: int | None = None
    #: The whole KV pool the engine allocated, in bytes (Quire only).
    kv_pool_bytes: int | None = None

    def figures(self) -> dict[str, float]:
        t = self.elapsed_s
        figures = {
            "requests_per_s": self.num_requests / t,
            "output_tokens_per_s": self.output_tokens / t,
            "total_tokens_per_s": (self.prompt_tokens + self.output_tokens) / t,
            "elapsed_s": t,
        }
        for name in ("peak_rss", "peak_kv", "kv_pool"):
            value = getattr(self, f"{name}_bytes")
            if value is not None:
                figures[f"{name}_mib"] = value / _MIB
        return figures


def run_quire(engine: LLMEngine, requests: list[BenchRequest],
              structured: StructuredOutputsParams | None = None,
              loras: Sequence[LoRARequest] = ()) -> ThroughputRun:
    """Time one pass of ``requests`` through ``engine`` (which must be idle).

    :param structured: a grammar every request follows (to measure the mask's cost).
    :param loras: LoRA adapters the requests take in turn (request ``i`` the
        ``i % len(loras)``-th); none: the base model.

    :raises RuntimeError: when the engine produced fewer tokens than asked (a request
        hit ``max_model_len``), since the figures would then be wrong.
    """
    pages = engine.core.block_manager
    reset_peak_rss(include_children=False)
    peak_pages = output_tokens = 0
    start = time.perf_counter()
    for i, request in enumerate(requests):
        params = greedy_params(request.output_len)
        if structured is not None:
            params.structured_outputs = structured
        engine.add_request(list(request.prompt_token_ids), params,
                           lora_request=loras[i % len(loras)] if loras else None)
    while engine.has_unfinished_requests():
        for out in engine.step(final_only=True):
            output_tokens += sum(len(c.token_ids) for c in out.outputs)
        # after the step: pages of sequences that finished in it are already back
        peak_pages = max(peak_pages, pages.num_used_blocks)
    elapsed = time.perf_counter() - start
    expected = sum(r.output_len for r in requests)
    if output_tokens != expected:
        raise RuntimeError(f"quire made {output_tokens} output tokens, expected {expected}: "
                           "a request was cut at max_model_len; raise it or shorten the workload")
    page_bytes = kv_page_bytes(engine)
    return ThroughputRun(
        elapsed_s=elapsed, num_requests=len(requests),
        prompt_tokens=sum(r.prompt_len for r in requests), output_tokens=output_tokens,
        peak_rss_bytes=peak_rss_bytes(include_children=False),
        peak_kv_bytes=peak_pages * page_bytes, kv_pool_bytes=pages.num_blocks * page_bytes)
