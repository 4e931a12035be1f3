"""The server's Prometheus metrics: what ``GET /metrics`` shows, named like vLLM's.

One :class:`ServerMetrics` belongs to the engine thread, which feeds it every
``RequestOutput`` the engine produces (aborted ones included; the server's requests are
``RequestOutputKind.DELTA``, so each output carries only its step's tokens) and renders it
between two steps; nothing else touches it, so it needs no lock. Request figures come from
``RequestOutput.metrics``; the scheduler's and KV cache's from an ``EngineStats`` snapshot
taken at render time. The list of metrics is in ``docs/http-api.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from quire.entrypoints.server.prometheus import Registry
from quire.outputs import RequestOutput

if TYPE_CHECKING:
    from quire.engine import EngineStats

# Latencies on CPU run from a millisecond (a decode step of a tiny model) to minutes (a
# long prompt behind a queue), so the buckets span both.
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,
                         0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
REQUEST_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                           10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0)
#: The reasons ``request_success_total`` is labelled with, shown from the start.
FINISH_REASONS = ("stop", "length", "abort")


def token_buckets(max_model_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_model_len`` (token-count histograms)."""
    bounds: list[int] = []
    scale = 1
    while True:
        for step in (1, 2, 5):
            if step * scale > max_model_len:
                return bounds or [1]
            bounds.append(step * scale)
        scale *= 10


@dataclass
class _Seen:
    """What the metrics already counted of a request still running."""

    last_token_time: float
    num_generation_tokens: int


class ServerMetrics:
    """The registry and the per-request bookkeeping that turns outputs into observations."""

    def __init__(self, max_model_len: int) -> None:
        self.registry = r = Registry()
        # from the engine, set at render time
        self.running = r.gauge("quire:num_requests_running",
                               "Sequences in the running batch (a request with n > 1 counts "
                               "once per running sample).")
        self.waiting = r.gauge("quire:num_requests_waiting",
                               "Sequences waiting to be scheduled.")
        self.kv_usage = r.gauge("quire:kv_cache_usage_perc",
                                "Share of KV-cache pages held by sequences (1 = full).")
        self.kv_used = r.gauge("quire:num_kv_blocks_used", "KV-cache pages held by sequences.")
        self.kv_total = r.gauge("quire:num_kv_blocks_total", "KV-cache pages in the pool.")
        self.prefix_queries = r.counter("quire:prefix_cache_queries_total",
                                        "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = r.counter("quire:prefix_cache_hits_total",
                                     "Prompt tokens found in the prefix cache.")
        self.prefix_hit_rate = r.gauge("quire:prefix_cache_hit_rate",
                                       "prefix_cache_hits_total / prefix_cache_queries_total "
                                       "(0 before any query).")
        self.preemptions = r.counter("quire:num_preemptions_total",
                                     "Times a running sequence lost its pages.")
        # from outputs, as they come
        self.prompt_tokens = r.counter("quire:prompt_tokens_total",
                                       "Prompt tokens of requests that produced a first token.")
        self.generation_tokens = r.counter("quire:generation_tokens_total",
                                           "Tokens generated (all samples).")
        self.success = r.counter("quire:request_success_total",
                                 "Finished requests by finish reason.", ["finished_reason"])
        for reason in FINISH_REASONS:
            self.success.labels(finished_reason=reason)
        self.ttft = r.histogram("quire:time_to_first_token_seconds",
                                "Seconds from arrival to the first output token.",
                                TOKEN_LATENCY_BUCKETS)
        self.itl = r.histogram("quire:inter_token_latency_seconds",
                               "Seconds between a request's consecutive token steps.",
                               TOKEN_LATENCY_BUCKETS)
        self.e2e = r.histogram("quire:e2e_request_latency_seconds",
                               "Seconds from arrival to finish, per finished request.",
                               REQUEST_LATENCY_BUCKETS)
        self.queue_time = r.histogram("quire:request_queue_time_seconds",
                                      "Seconds from arrival to the first schedule, per "
                                      "finished request that was scheduled.",
                                      REQUEST_LATENCY_BUCKETS)
        tokens = token_buckets(max_model_len)
        self.request_prompt = r.histogram("quire:request_prompt_tokens",
                                          "Prompt tokens per finished request.", tokens)
        self.request_generation = r.histogram("quire:request_generation_tokens",
                                              "Generated tokens per finished request.", tokens)
        self._seen: dict[str, _Seen] = {}

    def observe(self, out: RequestOutput) -> None:
        """Count what ``out``, a ``DELTA`` output, adds to the request's previous ones."""
        m = out.metrics
        if m is None:
            return
        seen = self._seen.get(out.request_id)
        if m.last_token_time is not None:
            if seen is None:
                seen = self._first_token(out)
            elif m.last_token_time > seen.last_token_time:
                self.itl.observe(m.last_token_time - seen.last_token_time)
                seen.last_token_time = m.last_token_time
            generated = sum(len(c.token_ids) for c in out.outputs)
            self.generation_tokens.inc(generated)
            seen.num_generation_tokens += generated
        if out.finished:
            seen = self._seen.pop(out.request_id, None)
            self._finished(out, seen.num_generation_tokens if seen is not None else 0)

    def _first_token(self, out: RequestOutput) -> _Seen:
        m = out.metrics
        assert m is not None and m.last_token_time is not None
        ttft = m.time_to_first_token
        if ttft is not None:
            self.ttft.observe(ttft)
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        seen = self._seen[out.request_id] = _Seen(m.last_token_time, 0)
        return seen

    def _finished(self, out: RequestOutput, num_generated: int) -> None:
        m = out.metrics
        assert m is not None
        self.success.labels(finished_reason=finish_reason(out)).inc()
        if m.e2e_latency is not None:
            self.e2e.observe(m.e2e_latency)
        if m.queue_time is not None:
            self.queue_time.observe(m.queue_time)
        self.request_prompt.observe(len(out.prompt_token_ids))
        self.request_generation.observe(num_generated)

    def render(self, stats: EngineStats) -> str:
        """The exposition text, with the engine figures of ``stats``."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_usage)
        self.kv_used.set(stats.num_used_blocks)
        self.kv_total.set(stats.num_blocks)
        self.prefix_queries.sync(stats.prefix_queries)
        self.prefix_hits.sync(stats.prefix_hits)
        self.prefix_hit_rate.set(stats.prefix_hits / stats.prefix_queries
                                 if stats.prefix_queries else 0.0)
        self.preemptions.sync(stats.num_preemptions)
        return self.registry.render()


def finish_reason(out: RequestOutput) -> str:
    """One reason for a finished request: "abort" if any sample was aborted, else "length"
    if any ran out of room, else "stop"."""
    reasons = {c.finish_reason for c in out.outputs}
    for reason in ("abort", "length"):
        if reason in reasons:
            return reason
    return "stop"
