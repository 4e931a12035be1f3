"""The server's Prometheus metrics: what ``GET /metrics`` shows, named like vLLM's, made
with ``prometheus_client``.

Two sources. Request figures (tokens, latencies, finishes) are observed by the API
server from every ``RequestOutput`` its engine front produces (aborted ones included; the
server's requests are ``RequestOutputKind.DELTA``, so each output carries only its step's
tokens); ``RequestOutput.metrics`` gives the timings. With several API servers
(``--api-server-count``) each writes them to ``prometheus_client``'s multiprocess files
(the serve command sets ``PROMETHEUS_MULTIPROC_DIR`` for them) and any of them renders
the sum. Engine figures (queues, KV pages, prefix cache, preemptions) come from the
``EngineStats`` each engine core sends with its outputs, labelled ``engine`` (the
data-parallel rank), and the live processes by role, at render time. The app labels
every sample with ``model``, the name the model is served by, and renders the families
of every model it serves as one text (:func:`labelled`, :func:`render_families`).

For SLO tracking (:mod:`quire.entrypoints.server.slo`), TTFT and queue time are also
observed by prompt-length band (label ``prompt_len_le``), and requests that missed an
objective ``quire serve`` was given are counted by objective (label ``slo``).

One :class:`ServerMetrics` belongs to the engine thread, which feeds and renders it;
nothing else touches it. The list of metrics is in ``docs/http-api.md``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector

from quire.entrypoints.server.slo import SLOTargets, band_of, prompt_len_bands
from quire.outputs import EmbeddingRequestOutput, RequestOutput

if TYPE_CHECKING:
    from quire.engine import EngineStats

#: The ``Content-Type`` of the exposition text (``generate_latest`` writes format 0.0.4).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: ``prometheus_client``'s own variable: where the API servers' metric files live.
MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"

# no ``*_created`` series: nothing here is reset, and vLLM shows none
prometheus_client.disable_created_metrics()

# Latencies on CPU run from a millisecond (a decode step of a tiny model) to minutes (a
# long prompt behind a queue), so the buckets span both.
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,
                         0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
REQUEST_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                           10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0)
#: The reasons ``request_success_total`` is labelled with, shown from the start.
FINISH_REASONS = ("stop", "length", "abort")
#: Process roles ``quire:processes`` counts.
ROLES = ("api_server", "engine_core", "worker")


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


class _EngineCollector:
    """The engine figures, from the stats last given to :meth:`ServerMetrics.render`."""

    def __init__(self) -> None:
        self.stats: Sequence[EngineStats] = ()
        self.processes: Mapping[str, int] = {}

    def describe(self) -> list[Metric]:
        return []  # nothing to check at registration; families come at collect time

    def collect(self) -> Iterator[Metric]:
        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=["engine"])

        running = gauge("quire:num_requests_running", "Sequences in the running batch (a "
                        "request with n > 1 counts once per running sample).")
        waiting = gauge("quire:num_requests_waiting", "Sequences waiting to be scheduled.")
        usage = gauge("quire:kv_cache_usage_perc",
                      "Share of KV-cache pages held by sequences (1 = full).")
        used = gauge("quire:num_kv_blocks_used", "KV-cache pages held by sequences.")
        total = gauge("quire:num_kv_blocks_total", "KV-cache pages in the pool.")
        rate = gauge("quire:prefix_cache_hit_rate", "prefix_cache_hits_total / "
                     "prefix_cache_queries_total (0 before any query).")
        queries = CounterMetricFamily("quire:prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.",
                                      labels=["engine"])
        hits = CounterMetricFamily("quire:prefix_cache_hits",
                                   "Prompt tokens found in the prefix cache.", labels=["engine"])
        preemptions = CounterMetricFamily("quire:num_preemptions",
                                          "Times a running sequence lost its pages.",
                                          labels=["engine"])
        added = CounterMetricFamily("quire:engine_requests",
                                    "Requests each engine core (data-parallel rank) took.",
                                    labels=["engine"])
        # speculative decoding (vLLM's spec_decode names), when the engine speculates
        # (its stats then count acceptances at each of num_speculative_tokens positions)
        speculating = any(s.spec_accepted_per_pos for s in self.stats)
        drafts = CounterMetricFamily("quire:spec_decode_num_drafts",
                                     "Verifications of draft tokens (speculative decoding).",
                                     labels=["engine"])
        draft_tokens = CounterMetricFamily("quire:spec_decode_num_draft_tokens",
                                           "Draft tokens proposed.", labels=["engine"])
        accepted = CounterMetricFamily("quire:spec_decode_num_accepted_tokens",
                                       "Draft tokens the target model accepted.",
                                       labels=["engine"])
        per_pos = CounterMetricFamily("quire:spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted at each position of their "
                                      "proposal (0 first).", labels=["engine", "position"])
        by_len = GaugeMetricFamily(
            "quire:kv_cache_usage_by_prompt_len_perc", "Share of KV-cache pages held by "
            "running sequences of each prompt-length band (prompts of at most "
            "prompt_len_le tokens, more than the band below); a page shared across bands "
            "counts in each.",
            labels=["engine", "prompt_len_le"])
        for i, s in enumerate(self.stats):
            engine = [str(i)]
            for bound, blocks in zip(s.prompt_len_bands, s.kv_blocks_by_prompt_len):
                by_len.add_metric([str(i), str(bound)], blocks / s.num_blocks
                                  if s.num_blocks else 0.0)
            drafts.add_metric(engine, s.spec_num_drafts)
            draft_tokens.add_metric(engine, s.spec_num_draft_tokens)
            accepted.add_metric(engine, s.spec_num_accepted_tokens)
            for pos, count in enumerate(s.spec_accepted_per_pos):
                per_pos.add_metric([str(i), str(pos)], count)
            running.add_metric(engine, s.num_running)
            waiting.add_metric(engine, s.num_waiting)
            usage.add_metric(engine, s.kv_usage)
            used.add_metric(engine, s.num_used_blocks)
            total.add_metric(engine, s.num_blocks)
            rate.add_metric(engine, s.prefix_hits / s.prefix_queries if s.prefix_queries else 0.0)
            queries.add_metric(engine, s.prefix_queries)
            hits.add_metric(engine, s.prefix_hits)
            preemptions.add_metric(engine, s.num_preemptions)
            added.add_metric(engine, s.num_requests)
        processes = GaugeMetricFamily("quire:processes", "Live processes of this server by "
                                      "role (any one dying stops the server).", labels=["role"])
        for role in ROLES:
            processes.add_metric([role], self.processes.get(role, 0))
        yield from (running, waiting, usage, by_len, used, total, rate, queries, hits,
                    preemptions, added, processes)
        if speculating:
            yield from (drafts, draft_tokens, accepted, per_pos)


class ServerMetrics:
    """The request metrics and the per-request bookkeeping that turns outputs into
    observations, plus the engine figures at render time.

    :param max_model_len: bounds the token-count histograms and the prompt-length bands.
    :param slo: the objectives whose misses are counted (default: none).
    """

    def __init__(self, max_model_len: int, slo: SLOTargets | None = None) -> None:
        self.slo = slo or SLOTargets()
        self.bands = prompt_len_bands(max_model_len)
        #: Several API servers share one metrics directory (``--api-server-count``).
        self.multiprocess = bool(os.environ.get(MULTIPROC_DIR_ENV))
        # In multiprocess mode the values live in files: the metrics register nowhere and
        # each render collects every process's files afresh.
        self.registry = CollectorRegistry()
        own = None if self.multiprocess else self.registry
        self._engine = _EngineCollector()
        self.prompt_tokens = Counter("quire:prompt_tokens",
                                     "Prompt tokens of requests that produced a first token.",
                                     registry=own)
        self.generation_tokens = Counter("quire:generation_tokens",
                                         "Tokens generated (all samples).", registry=own)
        self.success = Counter("quire:request_success", "Finished requests by finish reason.",
                               ["finished_reason"], registry=own)
        for reason in FINISH_REASONS:
            self.success.labels(finished_reason=reason)
        self.ttft = Histogram("quire:time_to_first_token_seconds",
                              "Seconds from arrival to the first output token.",
                              buckets=TOKEN_LATENCY_BUCKETS, registry=own)
        self.itl = Histogram("quire:inter_token_latency_seconds",
                             "Seconds between a request's consecutive token steps.",
                             buckets=TOKEN_LATENCY_BUCKETS, registry=own)
        self.e2e = Histogram("quire:e2e_request_latency_seconds",
                             "Seconds from arrival to finish, per finished request.",
                             buckets=REQUEST_LATENCY_BUCKETS, registry=own)
        self.queue_time = Histogram("quire:request_queue_time_seconds",
                                    "Seconds from arrival to the first schedule, per finished "
                                    "request that was scheduled.",
                                    buckets=REQUEST_LATENCY_BUCKETS, registry=own)
        tokens = token_buckets(max_model_len)
        self.request_prompt = Histogram("quire:request_prompt_tokens",
                                        "Prompt tokens per finished request.", buckets=tokens,
                                        registry=own)
        self.request_generation = Histogram("quire:request_generation_tokens",
                                            "Generated tokens per finished request.",
                                            buckets=tokens, registry=own)
        self.ttft_by_len = Histogram("quire:time_to_first_token_by_prompt_len_seconds",
                                     "Seconds from arrival to the first output token, by "
                                     "prompt-length band (prompts of at most prompt_len_le "
                                     "tokens, more than the band below).",
                                     ["prompt_len_le"], buckets=TOKEN_LATENCY_BUCKETS,
                                     registry=own)
        self.queue_by_len = Histogram("quire:request_queue_time_by_prompt_len_seconds",
                                      "Seconds from arrival to the first schedule, per "
                                      "finished request, by prompt-length band.",
                                      ["prompt_len_le"], buckets=REQUEST_LATENCY_BUCKETS,
                                      registry=own)
        self.slo_missed = Counter("quire:request_slo_missed",
                                  "Requests that missed an objective of quire serve "
                                  "(--slo-ttft, --slo-e2e), by objective.", ["slo"],
                                  registry=own)
        for name in self.slo.names:
            self.slo_missed.labels(slo=name)
        if not self.multiprocess:
            self.registry.register(self._engine)  # type: ignore[arg-type]
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
            self._finished(out, seen)

    def observe_embedding(self, out: EmbeddingRequestOutput) -> None:
        """Count a finished embedding request: its prompt tokens and finish, no output
        tokens (vLLM counts pooling requests the same way)."""
        m = out.metrics
        if m is None:
            return
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.success.labels(finished_reason=out.finish_reason).inc()
        self._latencies(m.e2e_latency, m.queue_time, len(out.prompt_token_ids))
        self.request_prompt.observe(len(out.prompt_token_ids))
        self.request_generation.observe(0)

    def _first_token(self, out: RequestOutput) -> _Seen:
        m = out.metrics
        assert m is not None and m.last_token_time is not None
        ttft = m.time_to_first_token
        if ttft is not None:
            self.ttft.observe(ttft)
            self.ttft_by_len.labels(band_of(len(out.prompt_token_ids), self.bands)).observe(ttft)
            if self.slo.ttft_s is not None and ttft > self.slo.ttft_s:
                self.slo_missed.labels(slo="ttft").inc()
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        seen = self._seen[out.request_id] = _Seen(m.last_token_time, 0)
        return seen

    def _finished(self, out: RequestOutput, seen: _Seen | None) -> None:
        """``seen``: what was counted of it, None if it never had a first token."""
        m = out.metrics
        assert m is not None
        self.success.labels(finished_reason=finish_reason(out)).inc()
        if seen is None and m.e2e_latency is not None and self.slo.ttft_s is not None \
                and m.e2e_latency > self.slo.ttft_s:
            # ended (aborted) with no first token after longer than the TTFT objective
            self.slo_missed.labels(slo="ttft").inc()
        self._latencies(m.e2e_latency, m.queue_time, len(out.prompt_token_ids))
        self.request_prompt.observe(len(out.prompt_token_ids))
        self.request_generation.observe(seen.num_generation_tokens if seen else 0)

    def _latencies(self, e2e: float | None, queue_time: float | None,
                   prompt_len: int) -> None:
        """A finished request's end-to-end and queue times, and its E2E objective."""
        if e2e is not None:
            self.e2e.observe(e2e)
            if self.slo.e2e_s is not None and e2e > self.slo.e2e_s:
                self.slo_missed.labels(slo="e2e").inc()
        if queue_time is not None:
            self.queue_time.observe(queue_time)
            self.queue_by_len.labels(band_of(prompt_len, self.bands)).observe(queue_time)

    def collect(self, stats: Sequence[EngineStats], processes: Mapping[str, int]
                ) -> list[Metric]:
        """The metric families: request metrics (of every API server), and the engine
        figures of ``stats`` (one per data-parallel rank) and ``processes`` (by role)."""
        self._engine.stats, self._engine.processes = stats, processes
        registry = self.registry
        if self.multiprocess:
            registry = CollectorRegistry()
            MultiProcessCollector(registry)
            registry.register(self._engine)  # type: ignore[arg-type]
        return list(registry.collect())

    def render(self, stats: Sequence[EngineStats], processes: Mapping[str, int]) -> str:
        """:meth:`collect`'s families as exposition text."""
        return render_families(self.collect(stats, processes))


def budget_families(budget: int, held: Mapping[str, int]) -> list[Metric]:
    """The KV budget several models share and what each model's pool holds of it, as
    the ledger says (one consistent reading), labelled ``model``."""
    total = GaugeMetricFamily("quire:kv_budget_bytes", "The KV memory budget this "
                              "server's models share.", labels=["model"])
    part = GaugeMetricFamily("quire:kv_held_bytes", "The bytes of the shared KV budget "
                             "this model's pool holds (used pages, cached prefixes, room "
                             "granted to grow).", labels=["model"])
    for model, value in held.items():
        total.add_metric([model], budget)
        part.add_metric([model], value)
    return [total, part]


def labelled(families: Iterable[Metric], **labels: str) -> list[Metric]:
    """Copies of ``families`` with ``labels`` added to every sample."""
    out = []
    for family in families:
        copy = Metric(family.name, family.documentation, family.type, family.unit)
        copy.samples = [s._replace(labels={**s.labels, **labels}) for s in family.samples]
        out.append(copy)
    return out


class _Fixed:
    """A collector of families collected already."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def render_families(families: Iterable[Metric]) -> str:
    """Exposition text of ``families``, those of one name (several models') merged into
    one family, as the format wants."""
    merged: dict[str, Metric] = {}
    for family in families:
        have = merged.get(family.name)
        if have is None:
            merged[family.name] = have = Metric(family.name, family.documentation,
                                                family.type, family.unit)
        have.samples.extend(family.samples)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(list(merged.values())))  # type: ignore[arg-type]
    return generate_latest(registry).decode()


def finish_reason(out: RequestOutput) -> str:
    """One reason for a finished request: "abort" if any sample was aborted, else "length"
    if any ran out of room, else "stop"."""
    reasons = {c.finish_reason for c in out.outputs}
    for reason in ("abort", "length"):
        if reason in reasons:
            return reason
    return "stop"
