"""What ``LLM.generate`` returns: vLLM's ``RequestOutput`` / ``CompletionOutput`` shape."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    """One generated sequence of a request. Text and ids are cumulative."""

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
