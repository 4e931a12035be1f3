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
