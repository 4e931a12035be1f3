"""From sampled tokens to what users see: text, logprobs, stopping, ``RequestOutput``.

The engine owns one :class:`OutputProcessor`; it owns each request's output state (text
so far, detokenizer offsets, logprobs). The scheduler's :class:`Sequence` holds the
tokens; this module never schedules anything.

Stopping rules, checked after each new token in this order (vLLM v1's: stop strings
are found while detokenizing, before the token rules):

=====================  ==================  ====================================
rule                   finish_reason       stop_reason
=====================  ==================  ====================================
a ``stop`` string      "stop"              the string; text cut before it
EOS (not ignore_eos)   "stop"              None
a ``stop_token_ids``   "stop"              the token id
``max_tokens``         "length"            None
the context is full    "length"            None
=====================  ==================  ====================================

None of the "stop" rules applies before ``min_tokens`` tokens exist (the sampler also
masks EOS and stop tokens until then). Stop strings are found by one Aho-Corasick
automaton per request (:mod:`quire.engine.stop_strings`), so a token costs the same whatever
their number. While a request streams, the last ``len(longest stop string) - 1``
characters are held back, since they may turn out to begin a stop string; streamed text
is therefore always a prefix of the final text.

Outputs come in the request's ``RequestOutputKind``: cumulative, or only what is new
since its previous output (each :class:`SeqOutput` remembers how much it reported).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from quire.engine.detokenizer import DetokenizerState, IncrementalDetokenizer
from quire.engine.sequence import Sequence
from quire.engine.stop_strings import StopMatcher, StopScan
from quire.outputs import (
    CompletionOutput,
    Logprob,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
    RequestOutputKind,
)
from quire.sampling_params import SamplingParams


@dataclass
class SeqOutput:
    """Output state of one sequence."""

    seq: Sequence
    detok: DetokenizerState
    text: str = ""
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float = 0.0
    #: Where the request's stop-string automaton stands in ``text`` (None: no stops).
    stop_scan: StopScan | None = None
    # what DELTA outputs already reported: characters, tokens, the finish
    sent_chars: int = 0
    sent_tokens: int = 0
    sent_finish: bool = False


@dataclass
class RequestState:
    """One request: its prompt and the output state of each of its ``n`` sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    outputs: list[SeqOutput] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    #: The request's stop strings as one automaton, shared by its samples.
    stops: StopMatcher | None = None
    #: A DELTA output already carried the prompt logprobs.
    sent_prompt_logprobs: bool = False
    # timings in time.monotonic() seconds, reported as RequestMetrics
    arrival_time: float = 0.0
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def finished(self) -> bool:
        return len(self.outputs) == self.params.n and all(
            o.seq.is_finished for o in self.outputs)

    def record_token(self, now: float) -> None:
        """One of the request's sequences sampled a token in the step that ended ``now``."""
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now

    def metrics(self) -> RequestMetrics:
        return RequestMetrics(
            arrival_time=self.arrival_time,
            first_scheduled_time=self.outputs[0].seq.first_scheduled_time,
            first_token_time=self.first_token_time,
            last_token_time=self.last_token_time,
            finished_time=self.finished_time,
        )


class OutputProcessor:
    """Detokenizes, applies the stopping rules, and builds ``RequestOutput``."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, eos_token_ids: frozenset[int],
                 max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def track(self, req: RequestState, seq: Sequence) -> SeqOutput:
        """Start output state for ``seq`` (sample ``seq.index`` of ``req``)."""
        if req.params.stop and req.stops is None:
            req.stops = StopMatcher(tuple(req.params.stop))
        out = SeqOutput(seq=seq, detok=self.detokenizer.start(len(req.prompt_token_ids)),
                        logprobs=[] if req.params.logprobs is not None else None,
                        stop_scan=req.stops.start() if req.stops is not None else None)
        req.outputs.append(out)
        req.outputs.sort(key=lambda o: o.seq.index)
        return out

    def append_token(self, req: RequestState, out: SeqOutput, token: int,
                     logprobs: PositionLogprobs | None = None) -> str | None:
        """Add a sampled token; returns the finish reason when a stopping rule fires."""
        seq, params = out.seq, out.seq.params
        seq.output_token_ids.append(token)
        if logprobs is not None and out.logprobs is not None:
            out.logprobs.append(logprobs)
            out.cumulative_logprob += logprobs[token].logprob
        decode = {"skip_special_tokens": params.skip_special_tokens,
                  "spaces_between_special_tokens": params.spaces_between_special_tokens}
        delta = self.detokenizer.step(out.detok, seq.token_ids, **decode)
        out.text += delta
        if req.stops is not None and out.stop_scan is not None and delta:
            found = req.stops.feed(out.stop_scan, delta,
                                   report=seq.num_output_tokens >= params.min_tokens)
            if found is not None:
                start, stop = found
                keep = start + len(stop) if params.include_stop_str_in_output else start
                out.text = out.text[:keep]
                seq.stop_reason = stop
                return "stop"
        reason = self._stop_reason(seq, token)
        if reason is not None:  # the last bytes will never complete a character now
            out.text += self.detokenizer.flush(out.detok, seq.token_ids, **decode)
        return reason

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        if seq.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                return "stop"
            if token in params.stop_token_ids:
                seq.stop_reason = token
                return "stop"
        if params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
            return "length"
        if seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def token_logprobs(self, token: int, logprob: float, rank: int,
                       top: list[tuple[int, float]]) -> PositionLogprobs:
        """The chosen token and the top alternatives, each with its text and rank."""
        entry: PositionLogprobs = {}
        for i, (tid, lp) in enumerate(top, start=1):
            entry[tid] = Logprob(lp, i, self.tokenizer.decode([tid]))
        if token not in entry:
            entry[token] = Logprob(logprob, rank, self.tokenizer.decode([token]))
        return entry

    def make_output(self, req: RequestState, num_cached_tokens: int) -> RequestOutput:
        """The request as users see it now, in its ``output_kind`` (cumulative unless it
        asked for deltas)."""
        delta = req.params.output_kind is RequestOutputKind.DELTA
        completions = []
        for out in req.outputs:
            c = self._delta(req, out) if delta else self._cumulative(req, out)
            if c is not None:
                completions.append(c)
        prompt_logprobs = None
        if req.prompt_logprobs is not None and not (delta and req.sent_prompt_logprobs):
            prompt_logprobs = list(req.prompt_logprobs)
            req.sent_prompt_logprobs = delta
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=completions,
            finished=req.finished,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=num_cached_tokens,
            metrics=req.metrics(),
        )

    def _cumulative(self, req: RequestState, out: SeqOutput) -> CompletionOutput:
        seq = out.seq
        return CompletionOutput(
            index=seq.index,
            text=out.text if seq.is_finished else _visible(out.text, req.stops),
            token_ids=list(seq.output_token_ids),
            logprobs=list(out.logprobs) if out.logprobs is not None else None,
            cumulative_logprob=out.cumulative_logprob if out.logprobs is not None else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )

    def _delta(self, req: RequestState, out: SeqOutput) -> CompletionOutput | None:
        """What ``out`` has that was not reported yet, or None if nothing (visible text
        only grows, so the next delta starts where this one ends)."""
        seq = out.seq
        text = out.text if seq.is_finished else _visible(out.text, req.stops)
        new_tokens = seq.output_token_ids[out.sent_tokens:]
        finish_news = seq.is_finished and not out.sent_finish
        if not new_tokens and len(text) == out.sent_chars and not finish_news:
            return None
        c = CompletionOutput(
            index=seq.index,
            text=text[out.sent_chars:],
            token_ids=new_tokens,
            logprobs=out.logprobs[out.sent_tokens:] if out.logprobs is not None else None,
            cumulative_logprob=out.cumulative_logprob if out.logprobs is not None else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )
        out.sent_chars, out.sent_tokens = len(text), len(seq.output_token_ids)
        out.sent_finish = seq.is_finished
        return c


def _visible(text: str, stops: StopMatcher | None) -> str:
    """Text safe to stream: without a tail that could still start a stop string."""
    hold = stops.longest - 1 if stops is not None else 0
    return text[: len(text) - hold] if hold > 0 else text
