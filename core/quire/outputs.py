"""What ``LLM.generate`` returns: vLLM's ``RequestOutput`` / ``CompletionOutput`` shape."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One generated sequence of a request."""

    index: int
    text: str
    token_ids: list[int]
    #: "stop" (EOS or a stop token), "length" (max_tokens or the context), "abort", or
    #: None while still running.
    finish_reason: str | None = None
    #: The stop token id that ended it, when one did.
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One request's prompt and its outputs."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    #: Prompt tokens served from the prefix cache.
    num_cached_tokens: int = 0
