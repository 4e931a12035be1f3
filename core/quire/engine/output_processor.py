"""The engine's front half: from the core's tokens to what users see: text, logprobs,
stop strings, ``RequestOutput``.

The core (:mod:`quire.engine.core`) sends, per step, each sequence's new token with its
raw logprobs, and the finish a token rule decided. This module owns each request's output
state (tokens so far, detokenizer offsets, text, logprobs, the finish) and never schedules
anything; when it finds a stop string it says so, and its engine tells the core to stop
that sequence.

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

The first row is applied here, the others by the core. None of the "stop" rules applies
before ``min_tokens`` tokens exist (the sampler also masks EOS and stop tokens until then).
Stop strings are found by one Aho-Corasick automaton per request
(:mod:`quire.engine.stop_strings`), so a token costs the same whatever their number. While
a request streams, the last ``len(longest stop string) - 1`` characters are held back,
since they may turn out to begin a stop string; streamed text is therefore always a prefix
of the final text. A core in another process may have sampled a token or two past a stop
string before it hears of it: those are dropped here.

Outputs come in the request's ``RequestOutputKind``: cumulative, or only what is new
since its previous output (each :class:`SeqOutput` remembers how much it reported).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from quire.engine.detokenizer import DetokenizerState, IncrementalDetokenizer
from quire.engine.messages import BeamResult, SeqUpdate
from quire.engine.stop_strings import StopMatcher, StopScan
from quire.outputs import (
    CompletionOutput,
    Logprob,
    PositionLogprobs,
    RequestOutput,
    RequestOutputKind,
    request_metrics,
)
from quire.sampling.logprobs import TokenLogprobs
from quire.sampling_params import SamplingParams


@dataclass(slots=True)
class SeqOutput:
    """Output state of one sequence (sample ``index`` of its request)."""

    index: int
    #: The sample's own parameters (``SamplingParams.for_sequence``).
    params: SamplingParams
    #: Prompt and output tokens: the detokenizer reads both.
    token_ids: list[int]
    num_prompt_tokens: int
    detok: DetokenizerState
    text: str = ""
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float = 0.0
    #: Where the request's stop-string automaton stands in ``text`` (None: no stops).
    stop_scan: StopScan | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # what DELTA outputs already reported: characters, tokens, the finish
    sent_chars: int = 0
    sent_tokens: int = 0
    sent_finish: bool = False

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


@dataclass(slots=True)
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
    #: Prompt tokens the core served from its prefix cache (sample 0's).
    num_cached_tokens: int = 0
    #: Sampling with ``best_of > n``: return only the best ``n`` samples by cumulative
    #: logprob, at the end (``params`` are the ``best_of`` samples the engine runs).
    keep: int | None = None
    #: ... and leave out their per-token logprobs (the user did not ask for them).
    hide_logprobs: bool = False
    # timings in time.monotonic() seconds, reported as RequestMetrics
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def finished(self) -> bool:
        """Every one of the ``n`` samples exists and finished (read per request per step:
        a plain loop, not a generator)."""
        if len(self.outputs) != self.params.n:
            return False
        for out in self.outputs:
            if out.finish_reason is None:
                return False
        return True

    def output(self, index: int) -> SeqOutput | None:
        """Sample ``index``'s state, or None before the core forked it."""
        outputs = self.outputs
        if index < len(outputs) and outputs[index].index == index:  # the usual place
            return outputs[index]
        for out in outputs:
            if out.index == index:
                return out
        return None


class OutputProcessor:
    """Detokenizes, finds stop strings, and builds ``RequestOutput``."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.detokenizer = IncrementalDetokenizer(tokenizer)

    def track(self, req: RequestState, index: int) -> SeqOutput:
        """Start output state for sample ``index`` of ``req``."""
        if req.params.stop and req.stops is None:
            req.stops = StopMatcher(tuple(req.params.stop))
        num_prompt = len(req.prompt_token_ids)
        out = SeqOutput(index=index, params=req.params.for_sequence(index),
                        token_ids=list(req.prompt_token_ids), num_prompt_tokens=num_prompt,
                        detok=self.detokenizer.start(num_prompt),
                        logprobs=[] if req.params.logprobs is not None else None,
                        stop_scan=req.stops.start() if req.stops is not None else None)
        req.outputs.append(out)
        req.outputs.sort(key=lambda o: o.index)
        return out

    def append(self, req: RequestState, update: SeqUpdate) -> bool:
        """Add the core's news for one sequence. True when a stop string ended it here
        (the core must then be told); a sequence that already finished takes nothing."""
        index, outputs = update.index, req.outputs
        if index < len(outputs) and outputs[index].index == index:  # req.output's usual place
            out = outputs[index]
        else:
            out = req.output(index) or self.track(req, index)
        if index == 0:
            req.num_cached_tokens = update.num_cached_tokens
            if req.first_scheduled_time is None:
                req.first_scheduled_time = update.first_scheduled_time
        if out.finish_reason is not None:
            return False
        token = update.token_id
        if token < 0:  # no token: the core only ended the sequence
            out.finish_reason, out.stop_reason = update.finish_reason, update.stop_reason
            return False
        params = out.params
        out.token_ids.append(token)
        if update.logprobs is not None and out.logprobs is not None:
            entry = self.token_logprobs(update.logprobs)
            out.logprobs.append(entry)
            out.cumulative_logprob += entry[token].logprob
        delta = self.detokenizer.step(out.detok, out.token_ids, params.skip_special_tokens,
                                      params.spaces_between_special_tokens)
        if delta:
            out.text += delta
        if delta and req.stops is not None and out.stop_scan is not None:
            found = req.stops.feed(out.stop_scan, delta,
                                   report=out.num_output_tokens >= params.min_tokens)
            if found is not None:
                start, stop = found
                keep = start + len(stop) if params.include_stop_str_in_output else start
                out.text = out.text[:keep]
                out.finish_reason, out.stop_reason = "stop", stop
                return True
        if update.finish_reason is not None:
            out.finish_reason, out.stop_reason = update.finish_reason, update.stop_reason
            # the last bytes will never complete a character now
            out.text += self.detokenizer.flush(
                out.detok, out.token_ids, skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens)
        return False

    def finish_beams(self, req: RequestState, result: BeamResult) -> None:
        """A beam search request's outcome: output ``i`` is hypothesis ``i`` (best
        first), its text decoded whole (beams come only at the end)."""
        params = req.params
        for index, hyp in enumerate(result.hypotheses):
            out = req.output(index) or self.track(req, index)
            out.token_ids[out.num_prompt_tokens:] = hyp.token_ids
            out.text = self.tokenizer.decode(
                hyp.token_ids, skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens)
            out.cumulative_logprob = hyp.cum_logprob
            out.finish_reason = hyp.finish_reason
        for index in range(len(result.hypotheses), params.n):  # fewer beams ended than n
            (req.output(index) or self.track(req, index)).finish_reason = "length"
        if req.first_scheduled_time is None:
            req.first_scheduled_time = result.first_scheduled_time

    def abort(self, req: RequestState) -> None:
        """End every sample not finished yet (forked or not) with reason "abort"."""
        for index in range(req.params.n):
            out = req.output(index) or self.track(req, index)
            if not out.is_finished:
                out.finish_reason = "abort"

    def token_logprobs(self, lp: TokenLogprobs) -> PositionLogprobs:
        """The chosen token and the top alternatives, each with its text and rank."""
        entry: PositionLogprobs = {}
        for i, (tid, logprob) in enumerate(lp.top, start=1):
            entry[tid] = Logprob(logprob, i, self.tokenizer.decode([tid]))
        if lp.token_id not in entry:
            entry[lp.token_id] = Logprob(lp.logprob, lp.rank,
                                         self.tokenizer.decode([lp.token_id]))
        return entry

    def make_output(self, req: RequestState, finished: bool | None = None) -> RequestOutput:
        """The request as users see it now, in its ``output_kind`` (cumulative unless it
        asked for deltas).

        :param finished: ``req.finished``, when the caller already knows it.

        Per request per step while streaming: its samples' outputs are built in a loop
        here, without a call per sample or property reads.
        """
        if finished is None:
            finished = req.finished
        # best_of > n: one output, at the end, whole (as a delta it is the same)
        delta = req.params.output_kind is RequestOutputKind.DELTA and req.keep is None
        stops = req.stops
        hold = stops.longest - 1 if stops is not None else 0
        beams = req.params.use_beam_search  # a beam's sum of logprobs is its rank
        picked = req.outputs if req.keep is None else _best(req)
        completions = []
        for out in picked:
            finish, text, logprobs = out.finish_reason, out.text, out.logprobs
            if req.keep is not None:
                beams, logprobs = True, None if req.hide_logprobs else logprobs
            if finish is None and hold > 0:  # without a tail that may start a stop string
                text = text[: len(text) - hold]
            if delta:
                c = _delta(out, text, finish, logprobs, beams)
                if c is not None:
                    completions.append(c)
                continue
            completions.append(CompletionOutput(
                out.index if req.keep is None else len(completions), text,
                out.token_ids[out.num_prompt_tokens:],
                None if logprobs is None else list(logprobs),
                None if logprobs is None and not beams else out.cumulative_logprob,
                finish, out.stop_reason))
        prompt_logprobs = None
        if req.prompt_logprobs is not None and not (delta and req.sent_prompt_logprobs):
            prompt_logprobs = list(req.prompt_logprobs)
            req.sent_prompt_logprobs = delta
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, completions,
                             finished, prompt_logprobs, req.num_cached_tokens,
                             request_metrics(req.arrival_time, req.first_scheduled_time,
                                             req.first_token_time, req.last_token_time,
                                             req.finished_time))


def _best(req: RequestState) -> list[SeqOutput]:
    """The ``keep`` samples with the highest cumulative logprob, best first (vLLM's
    ``best_of``; ties keep sample order)."""
    ranked = sorted(req.outputs, key=lambda o: -o.cumulative_logprob)
    return ranked[: req.keep]


def _delta(out: SeqOutput, text: str, finish: str | None,
           logprobs: list[PositionLogprobs] | None,
           beams: bool = False) -> CompletionOutput | None:
    """What ``out`` has that was not reported yet, or None if nothing (``text``, its
    visible text, only grows, so the next delta starts where this one ends)."""
    sent_tokens = out.sent_tokens
    new_tokens = out.token_ids[out.num_prompt_tokens + sent_tokens:]
    finish_news = finish is not None and not out.sent_finish
    if not new_tokens and len(text) == out.sent_chars and not finish_news:
        return None
    c = CompletionOutput(
        out.index, text[out.sent_chars:], new_tokens,
        logprobs[sent_tokens:] if logprobs is not None else None,
        out.cumulative_logprob if logprobs is not None or beams else None,
        finish, out.stop_reason)
    out.sent_chars, out.sent_tokens = len(text), sent_tokens + len(new_tokens)
    out.sent_finish = finish is not None
    return c

