"""What ``LLM.generate`` returns: vLLM's ``RequestOutput`` / ``CompletionOutput`` shape."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class RequestOutputKind(enum.Enum):
    """What each ``RequestOutput`` of a running request carries (vLLM's names).

    ``CUMULATIVE``: everything so far (the offline API's default). ``DELTA``: only what is
    new since the request's previous output: text, token ids and logprobs of that step,
    prompt logprobs in the first output only; a sample with nothing new is left out until
    it finishes. Streams need only that, and it keeps what a slow reader's queue holds
    proportional to what it has not read. ``FINAL_ONLY``: one output, when it finishes.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(frozen=True)
class Logprob:
    """One candidate token at one position."""

    #: Natural log of the token's probability under the model's raw output.
    logprob: float
    #: 1 for the most likely token of the vocabulary, 2 for the next, ...
    rank: int | None = None
    #: The token's text on its own.
    decoded_token: str | None = None


#: Per position: token id -> Logprob, holding the chosen token and the top-k alternatives.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One generated sequence of a request. Text, ids and logprobs are cumulative, or
    what is new since the previous output for ``RequestOutputKind.DELTA``."""

    index: int
    text: str
    token_ids: list[int]
    #: Per generated token, when ``logprobs`` was asked for.
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    #: "stop" (EOS, a stop token or a stop string), "length" (max_tokens or the context),
    #: "abort", or None while still running.
    finish_reason: str | None = None
    #: The stop token id or stop string that ended it (None for EOS or length).
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, delta: CompletionOutput) -> None:
        """Append ``delta`` (the same sample's next ``DELTA`` output) in place."""
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(delta.logprobs)
        self.cumulative_logprob = delta.cumulative_logprob
        self.finish_reason = delta.finish_reason
        self.stop_reason = delta.stop_reason


@dataclass(frozen=True)
class RequestMetrics:
    """When things happened to one request, in ``time.monotonic()`` seconds (engine side).

    Compare these with each other, not with wall-clock time. A field is None until its
    event happened (an abort can come before any of them).
    """

    #: ``add_request`` was called.
    arrival_time: float
    #: The request first left the waiting queue (its first sample, for ``n > 1``).
    first_scheduled_time: float | None = None
    #: The step that sampled the first output token ended.
    first_token_time: float | None = None
    #: The step that sampled the newest output token ended.
    last_token_time: float | None = None
    #: The request finished (stopped, hit its length, or was aborted).
    finished_time: float | None = None

    @property
    def queue_time(self) -> float | None:
        """Seconds spent waiting before the first schedule."""
        return _since(self.arrival_time, self.first_scheduled_time)

    @property
    def time_to_first_token(self) -> float | None:
        return _since(self.arrival_time, self.first_token_time)

    @property
    def e2e_latency(self) -> float | None:
        """Seconds from arrival to finish."""
        return _since(self.arrival_time, self.finished_time)


def _since(start: float, end: float | None) -> float | None:
    return None if end is None else end - start


def request_metrics(arrival_time: float, first_scheduled_time: float | None,
                    first_token_time: float | None, last_token_time: float | None,
                    finished_time: float | None) -> RequestMetrics:
    """``RequestMetrics(...)`` with these fields, built without its frozen ``__init__``.

    The engine's front builds one per request per step; a frozen dataclass's ``__init__``
    sets each field through ``object.__setattr__`` (~1 us here), one dict update ~0.3 us.
    The result equals, hashes and prints as the constructor's (a test checks every field).
    """
    metrics = object.__new__(RequestMetrics)
    metrics.__dict__.update(
        arrival_time=arrival_time, first_scheduled_time=first_scheduled_time,
        first_token_time=first_token_time, last_token_time=last_token_time,
        finished_time=finished_time)
    return metrics


@dataclass
class RequestOutput:
    """One request's prompt and its outputs so far (``finished`` when all are done)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    #: Per prompt token when ``prompt_logprobs`` was asked for; the first is None (nothing
    #: predicts it).
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    #: Prompt tokens served from the prefix cache.
    num_cached_tokens: int = 0
    #: Timings so far; not part of the output's value (left out of ``==``).
    metrics: RequestMetrics | None = field(default=None, compare=False)

    def add(self, delta: RequestOutput) -> None:
        """Merge ``delta`` (this request's next ``DELTA`` output) into this one in place,
        so that a run of deltas adds up to the cumulative output."""
        own = {c.index: c for c in self.outputs}
        for c in delta.outputs:
            if c.index in own:
                own[c.index].add(c)
            else:
                self.outputs.append(CompletionOutput(
                    c.index, c.text, list(c.token_ids),
                    list(c.logprobs) if c.logprobs is not None else None,
                    c.cumulative_logprob, c.finish_reason, c.stop_reason))
        self.outputs.sort(key=lambda c: c.index)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.finished = delta.finished
        self.num_cached_tokens = delta.num_cached_tokens
        self.metrics = delta.metrics


@dataclass(frozen=True)
class EmbeddingOutput:
    """vLLM's holder of a vector, for code that reads ``out.outputs.embedding``."""

    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """What ``LLM.embed`` returns per prompt: its pooled vector (vLLM's
    ``EmbeddingRequestOutput``; the vector is also on the output itself)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    #: The pooled (and, as the model's pooling says, normalised) vector; empty when
    #: aborted.
    embedding: list[float]
    #: "stop" once computed, "abort" when stopped before.
    finish_reason: str = "stop"
    finished: bool = True
    #: Timings; not part of the output's value (left out of ``==``).
    metrics: RequestMetrics | None = field(default=None, compare=False)

    @property
    def outputs(self) -> EmbeddingOutput:
        """The vector as vLLM spells it: ``out.outputs.embedding``."""
        return EmbeddingOutput(self.embedding)
